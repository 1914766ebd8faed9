"""Loss scaling for training on several replicas, as TensorFlow's `tf.nn` has it.

`compute_average_loss` divides a replica's summed per-example losses by the global batch size,
and `scale_regularization_loss` divides a term every replica adds by the number of replicas, so
that `all_reduce('sum')` of the replicas' gradients trains as one device would.
"""

from jaxstrategy._src.values.losses import compute_average_loss as compute_average_loss
from jaxstrategy._src.values.losses import scale_regularization_loss as scale_regularization_loss

__all__ = ("compute_average_loss", "scale_regularization_loss")
