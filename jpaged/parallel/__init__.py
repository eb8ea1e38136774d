"""Several devices: tensor parallelism over a mesh axis ("model") and independent replicas
over another ("data"). See ``docs/parallel.md``."""

from jpaged.parallel.layout import MODEL_AXIS as MODEL_AXIS
from jpaged.parallel.layout import TensorParallelLayout as TensorParallelLayout
from jpaged.parallel.mesh import DATA_AXIS as DATA_AXIS
from jpaged.parallel.mesh import make_mesh as make_mesh
from jpaged.parallel.multihost import broadcast_from_leader as broadcast_from_leader
from jpaged.parallel.multihost import is_leader as is_leader
from jpaged.parallel.tp import TensorParallelModel as TensorParallelModel
from jpaged.parallel.tp import create_cache as create_cache
from jpaged.parallel.tp import shard_model as shard_model
