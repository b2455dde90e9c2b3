"""Everything about device meshes and shardings lives here.

Axes: `data` (batch replicas), `fsdp` (batch and parameter sharding), `tensor`
(model-parallel dimensions). Model parameters name their dimensions with
logical axes (`vocab`, `embed`, `heads`, `kv_heads`, `mlp`, `norm`); the rules,
which come from the config, map each logical axis to mesh axes. A dimension
that the mesh axes do not divide evenly stays replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """Mesh shape over (data, fsdp, tensor); −1 in one place takes the remaining devices."""

  mesh_shape: tuple[int, int, int] = (1, -1, 1)
  rules: tuple[tuple[str, MeshAxes], ...] = DEFAULT_RULES

  def __post_init__(self):
    if len(self.mesh_shape) != 3 or sum(d == -1 for d in self.mesh_shape) > 1:
      raise ValueError(f"mesh_shape must give sizes of {MESH_AXES} with at most one -1; "
                       f"got {self.mesh_shape}")
    for name, axes in self.rules:
      for axis in (axes,) if isinstance(axes, str) else (axes or ()):
        if axis not in MESH_AXES:
          raise ValueError(f"rules: logical axis {name!r} maps to unknown mesh axis {axis!r}; "
                           f"allowed: {MESH_AXES}")


def mesh_shape_for(config: ShardingConfig, num_devices: int) -> tuple[int, int, int]:
  shape = list(config.mesh_shape)
  known = math.prod(d for d in shape if d != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh_shape {config.mesh_shape} does not divide {num_devices} devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh_shape {tuple(shape)} needs {math.prod(shape)} devices; "
                     f"{num_devices} are available")
  return tuple(shape)


def make_mesh(config: ShardingConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape_for(config, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, MeshAxes]]) -> PartitionSpec:
  """PartitionSpec of one array: each logical axis through the rules, if the mesh divides it."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(logical_axes, shape, strict=True):
    axes = table.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
      used.update(axes)
      spec.append(axes[0] if len(axes) == 1 else axes)
    else:
      spec.append(None)
  return PartitionSpec(*spec)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules) -> object:
  """NamedSharding for each Variable of an (abstract) NNX state, from its `logical_axes`."""
  def one(variable):
    axes = variable.get_metadata().get("logical_axes") if _is_variable(variable) else None
    if axes is None:
      return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(axes, variable.shape, mesh, rules))
  return jax.tree.map(one, state, is_leaf=_is_variable)


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh, rules) -> nnx.Module:
  """Build a model whose parameters are created directly with their shardings (from shapes first)."""
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)
  state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def shard_model(model: nnx.Module, mesh: Mesh, rules) -> nnx.Module:
  """Place an existing model's variables with the shardings of the rules (e.g. after loading)."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
  return model


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  """Arrays [B, ...] split over the mesh axes of the `batch` rule, replicated on the rest."""
  axes = dict(rules).get("batch")
  return NamedSharding(mesh, PartitionSpec(axes, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
