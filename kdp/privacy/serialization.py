"""`dp_accounting.DpEvent`s to and from JSON-serialisable dicts (the ledger's form)."""

import attr
import dp_accounting


def event_to_config(event):
    """A JSON-serialisable dict describing ``event`` (any `dp_accounting.DpEvent`)."""
    def convert(value):
        if isinstance(value, dp_accounting.DpEvent):
            return {"class_name": type(value).__name__,
                    **{k: convert(v) for k, v in attr.asdict(value, recurse=False).items()}}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
        raise ValueError(f"cannot serialise {value!r} in a DpEvent")

    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(f"expected a dp_accounting.DpEvent, got {event!r}")
    return convert(event)


def event_from_config(config):
    """The `dp_accounting.DpEvent` described by `event_to_config`'s dict."""
    def convert(value):
        if isinstance(value, dict):
            value = dict(value)
            name = value.pop("class_name")
            cls = getattr(dp_accounting, name, None) or getattr(dp_accounting.dp_event, name, None)
            if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
                raise ValueError(f"unknown DpEvent in {config}")
            return cls(**{k: convert(v) for k, v in value.items()})
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(config)
