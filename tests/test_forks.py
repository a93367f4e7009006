"""The tests' forked processes (`tests/_forks.py`) behave as ``python SCRIPT ARGS``."""

import json
import os

import pytest
from _forks import Forks


@pytest.fixture
def script(tmp_path):
    def write(source, name="script.py"):
        path = tmp_path / name
        path.write_text(source)
        return path

    return write


def test_a_child_reports_its_exit_code_and_output(forks, script, tmp_path):
    """An exception is code 1 with its traceback (the script's file and line),
    ``sys.exit(3)`` is 3, ``sys.exit("said")`` prints and is 1, a thread still
    running is waited for."""
    cases = {"print('ran')": 0, "x = 1\nraise ValueError('seen')": 1, "import sys\nsys.exit(3)": 3,
             "import sys\nsys.exit('said')": 1,
             "import threading, time\nthreading.Thread(target=lambda: (time.sleep(1), "
             "print('joined'))).start()": 0}
    outcomes = [forks.run([script(source)], tmp_path, tmp_path / "log") for source in cases]
    assert [code for code, _ in outcomes] == list(cases.values())
    ran, raised, _, said, joined = (output for _, output in outcomes)
    assert "ran" in ran and "said" in said and "joined" in joined
    assert f'File "{tmp_path / "script.py"}", line 2' in raised and "ValueError: seen" in raised


def test_a_child_has_the_argv_directory_and_environment_of_a_fresh_process(forks, script, tmp_path):
    """``sys.argv``, ``sys.path[0]``, the working directory and exactly the given
    environment (read by C code too: ``getenv``), and ``__name__ == "__main__"``."""
    (tmp_path / "work").mkdir()
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    path = script(
        "import ctypes, json, os, sys\nimport helper\n"
        "getenv = ctypes.CDLL(None).getenv\ngetenv.restype = ctypes.c_char_p\n"
        "print(json.dumps([sys.argv, sys.path[0], os.getcwd(), helper.VALUE, __name__,\n"
        "                  sorted(os.environ), getenv(b'KDP_FORK_TEST').decode()]))\n")
    env = {"KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "tensorflow"), "KDP_FORK_TEST": "x y"}
    code, output = forks.run([path, "--flag", 3], tmp_path / "work", tmp_path / "log", env=env)
    assert code == 0, output
    argv, first, cwd, value, name, variables, seen = json.loads(output.strip().splitlines()[-1])
    assert argv == [str(path), "--flag", "3"] and first == str(tmp_path)
    assert cwd == str(tmp_path / "work") and value == 7 and name == "__main__"
    assert variables == sorted(env) and seen == "x y"


def test_children_run_side_by_side_and_one_past_its_time_is_killed(forks, script, tmp_path):
    """Two children at once (each waits for a file the other writes), the codes of
    each; a child that overruns ``timeout`` is killed (None), and the parent goes on."""
    a = script("import os, time\nopen('a', 'w').close()\n"
               "while not os.path.exists('b'): time.sleep(0.01)\n", "a.py")
    b = script("import os, sys, time\nopen('b', 'w').close()\n"
               "while not os.path.exists('a'): time.sleep(0.01)\nsys.exit(5)\n", "b.py")
    first = forks.start([a], tmp_path, tmp_path / "log-a")
    second = forks.start([b], tmp_path, tmp_path / "log-b")
    assert (forks.wait(second, 60), forks.wait(first, 60)) == (5, 0)
    sleeper = script("import time\ntime.sleep(60)\n", "sleep.py")
    assert forks.run([sleeper], tmp_path, tmp_path / "log", timeout=1)[0] is None
    assert forks.run([a], tmp_path, tmp_path / "log")[0] == 0


def test_a_child_asking_for_another_backend_is_refused(forks, script, tmp_path):
    """The parent has imported Keras on one backend: a child cannot have another."""
    other = {"jax": "tensorflow"}.get(os.environ.get("KERAS_BACKEND", "tensorflow"), "jax")
    code, output = forks.run([script("print('ran')")], tmp_path, tmp_path / "log",
                             env={**os.environ, "KERAS_BACKEND": other})
    assert code == 2 and f"not {other}" in output and "ran" not in output


def test_keras_and_kdp_are_imported_and_no_backend_started_before_the_fork(forks, script, tmp_path):
    """What a child finds already imported (the time saved) and not yet started (what
    it may still configure, as a fresh process would)."""
    code, output = forks.run([script(
        "import sys\nimport keras\n"
        "print('modules', 'kdp' in sys.modules, 'keras' in sys.modules)\n"
        "bridge = sys.modules.get('jax._src.xla_bridge')\n"
        "print('jax client', bool(bridge and bridge._backends))\n"
        "if keras.backend.backend() == 'tensorflow':\n"
        "    import tensorflow as tf\n"
        "    cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "    print('tensorflow devices', len(tf.config.list_logical_devices('CPU')))\n")],
        tmp_path, tmp_path / "log")
    assert code == 0, output
    assert "modules True True" in output and "jax client False" in output
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        assert "tensorflow devices 2" in output


def test_fresh_processes_instead_of_forks_behave_the_same(script, tmp_path, monkeypatch):
    """``KDP_TEST_FRESH_PROCESSES=1`` (and any platform but Linux): each child is a
    new interpreter, with nothing imported, the same exit codes and output."""
    monkeypatch.setenv("KDP_TEST_FRESH_PROCESSES", "1")
    fresh = Forks()
    try:
        code, output = fresh.run([script("import os, sys\nprint('kdp' in sys.modules, os.getcwd())\n"
                                         "raise SystemExit(4)\n")], tmp_path, tmp_path / "log")
        assert code == 4 and f"False {tmp_path}" in output, output
        code, output = fresh.run([script("raise ValueError('seen')")], tmp_path, tmp_path / "log")
        assert code == 1 and "ValueError: seen" in output
    finally:
        fresh.close()
