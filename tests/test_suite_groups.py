"""The suite's own scheduling (`tests/_groups.py`): the tests that share a trained
fixture or run stay on one pytest-xdist worker, whatever pytest's version."""

import ast
import os
import types

import _groups
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _functions(module):
    with open(os.path.join(HERE, module)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("entry", sorted(_groups.ONE_WORKER))
def test_every_one_worker_entry_names_a_test_module_or_function(entry):
    module, _, function = entry.partition("::")
    assert os.path.exists(os.path.join(HERE, module)), f"{entry}: no module {module}"
    assert not function or function in _functions(module), f"{entry}: no test {function}"


def _scheduler(dist="loadgroup"):
    pytest.importorskip("xdist")
    config = types.SimpleNamespace(getvalue={"dist": dist, "tx": ["2*popen"]}.get)
    return _groups.pytest_xdist_make_scheduler(config=config, log=None)


def test_a_listed_module_and_the_listed_tests_of_a_module_are_one_scope_each():
    scope = _scheduler()._split_scope
    module = {scope(f"tests/test_distributed.py::{name}") for name in
              ("test_noise_std_matches_single_device", "test_clipping_path",
               "test_poisson_batches_shard_evenly_at_the_global_rate")}
    listed = {scope(f"tests/test_layers.py::{name}") for name in
              ("test_gradient_bounds_are_sound[convnet]", "test_gradient_bounds_are_sound[mlp]",
               "test_bounds_are_not_vacuous", "test_model_save_load[functional]")}
    assert len(module) == 1 and len(listed) == 1 and module != listed


def test_other_tests_are_scheduled_one_by_one_and_xdist_groups_still_count():
    scope = _scheduler()._split_scope
    others = ["tests/test_layers.py::test_something_else[convnet]",
              "tests/test_layers.py::test_something_else[mlp]", "tests/test_gate.py::test_a"]
    assert [scope(nodeid) for nodeid in others] == others
    assert scope("tests/test_gate.py::test_a@pair") == scope("tests/test_gate.py::test_b@pair")


def test_other_distributions_are_left_to_pytest_xdist():
    assert _scheduler("load") is None
