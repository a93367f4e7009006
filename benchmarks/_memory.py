"""The peak memory of a benchmark's process, without importing Keras (so that the
PyTorch comparison scripts, which run in an environment of their own, share it)."""


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
