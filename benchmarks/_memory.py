"""The peak memory of a benchmark's process and the table of the transformer
benchmarks, without importing Keras (so that the PyTorch comparison script,
which runs in an environment of its own, shares them)."""



def peak_rss_mb():
    """This process's peak RSS in MB (it sees XLA's and TensorFlow's allocators):
    ``VmHWM`` on Linux, reset by ``exec``, unlike ``ru_maxrss``, which a child
    started by `subprocess` can inherit from its parent's peak; elsewhere
    `resource.getrusage`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_table(results, baseline):
    """Print ``{kind: {"time": seconds a step, "peak_mb": MB}}`` with each time's and
    memory's ratio to those of ``baseline``."""
    base = results.get(baseline)
    print(f"{'kind':>9} | {'ms/step':>8} {'/ ' + baseline:>8} | {'MB':>6} {'ratio':>6}")
    for kind, r in results.items():
        ratios = [r[key] / base[key] if base and base[key] > 0 else float("nan") for key in ("time", "peak_mb")]
        print(f"{kind:>9} | {r['time'] * 1e3:8.1f} {ratios[0]:8.2f} | {r['peak_mb']:6.0f} {ratios[1]:6.2f}",
              flush=True)
