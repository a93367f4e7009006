"""Argument checks shared by the modules of `kdp.privacy`."""


def check_positive(**values):
    """Raise `ValueError` unless every value is ``> 0``."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_count(count, name):
    """``count`` as an ``int >= 0`` (else `ValueError`)."""
    count = int(count)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


def check_delta(delta):
    """Raise `ValueError` unless ``0 < delta < 1``."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
