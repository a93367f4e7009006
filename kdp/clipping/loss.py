"""Per-example values of a Keras loss."""

from keras import ops


def per_example_loss(loss, y, y_pred):
    """``loss.call`` summed over every non-batch axis: shape ``(batch,)``."""
    values = loss.call(y, y_pred)
    if len(values.shape) > 1:
        values = ops.sum(ops.reshape(values, (ops.shape(values)[0], -1)), axis=1)
    return values
