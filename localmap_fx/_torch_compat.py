"""Every private torch symbol localmap_fx uses, one row each.

Torch gives no stability promise for names below a leading underscore, so
they are reached only through this module: ``SYMBOLS`` says where each one
lives, the torch version it was checked against and why we need it, and a
torch upgrade is a review of this one file (``tests/unit/test_torch_compat.py``
resolves every row on the installed torch).

Names resolve lazily on first access (``from .._torch_compat import
DTensorSpec``) and are then cached in this module's globals: many rows live
in torch modules that are slow to import (Dynamo, Inductor, AOTAutograd), and
``import localmap_fx`` and the eager path must not pay for them.  A call site
that imports a name inside a function today keeps doing so; a module-level
``from`` import resolves once, at import time, so the hot path never goes
through ``__getattr__``.

``PRIVATE_ATTRIBUTES`` lists the private attributes we read on torch objects
(``DTensor._local_tensor``...).  Those cannot be routed through a module; the
table documents them and the test checks each still exists.  We only read
them: localmap_fx never writes a torch object's private attribute.
"""

# The imports under TYPE_CHECKING only give type checkers the real types of
# the names __getattr__ serves; nothing in this file uses them.
# ruff: noqa: F401

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

CHECKED = "2.14.1"


@dataclass(frozen=True)
class Symbol:
    """``name`` here is ``module.attr`` in torch (``attr`` None: the module itself)."""

    name: str
    module: str
    attr: str | None
    checked: str
    why: str
    # a pip package without which the row cannot resolve ("" if none)
    needs: str = ""

    def resolve(self) -> Any:
        mod = importlib.import_module(self.module)
        if self.attr is None:
            return mod
        return functools.reduce(getattr, self.attr.split("."), mod)


@dataclass(frozen=True)
class PrivateAttribute:
    """A private attribute read (never written) on instances or members of ``owner``."""

    name: str
    owner: str
    checked: str
    why: str


_DT = "torch.distributed.tensor"

SYMBOLS: tuple[Symbol, ...] = (
    # --- torch._C --------------------------------------------------------------------------
    Symbol("AutoDispatchBelowAutograd", "torch._C", "_AutoDispatchBelowAutograd", CHECKED,
           "with nothing to differentiate, our runtimes call the all_reduce between graphs below autograd, "
           "skipping the functional collectives' Python autograd kernels (below_autograd.py)"),
    Symbol("DisableTorchFunction", "torch._C", "DisableTorchFunction", CHECKED,
           "rule math and DTensor propagation run without re-entering torch-function modes"),
    Symbol("get_current_graph_task_keep_graph", "torch._C", "_autograd._get_current_graph_task_keep_graph",
           CHECKED, "a layer backward with donated buffers refuses retain_graph=True, as AOTAutograd does"),
    Symbol("get_work_registry_size", "torch._C", "_distributed_c10d._get_work_registry_size", CHECKED,
           "test teardown waits until no collective work is pending"),
    # --- Dynamo (imported only when capturing or compiling) ------------------------------
    Symbol("assume_constant_result", "torch._dynamo", "assume_constant_result", CHECKED,
           "capture runs its checks in real Python at trace time; Dynamo keeps the result as a constant"),
    Symbol("register_backend", "torch._dynamo.backends.registry", "register_backend", CHECKED,
           "registers the backend name when the package is not installed (no entry point)"),
    Symbol("registered_backends", "torch._dynamo.backends.registry", "_BACKENDS", CHECKED,
           "registering twice raises, so the name is looked up first"),
    Symbol("comptime", "torch._dynamo.comptime", "comptime", CHECKED,
           "capture checks and plans a call on Dynamo's view of its locals, at trace time"),
    Symbol("skip_frame", "torch._dynamo", "skip_frame", CHECKED,
           "a frame that starts at a local_map call with pinned arguments is left untraced"),
    Symbol("InstructionTranslator", "torch._dynamo.symbolic_convert", "InstructionTranslator", CHECKED,
           "the root frame's real locals tell whether an argument is pinned (no guard added)"),
    Symbol("get_static_address_type", "torch._dynamo.utils", "get_static_address_type", CHECKED,
           "a tensor Dynamo pins by identity (optimizer state) is recognised"),
    Symbol("dynamo_counters", "torch._dynamo.utils", "counters", CHECKED,
           "the log line of a compile counts torch's cache hits and misses"),
    Symbol("inductor_config", "torch._inductor", "config", CHECKED,
           "the mesh stand-in is marked cacheable in a scoped config.patch"),
    Symbol("ShortenTraceback", "torch._dynamo.exc", "ShortenTraceback", CHECKED,
           "our compile-time errors subclass it, so Dynamo re-raises them untouched"),
    Symbol("ConstantVariable", "torch._dynamo.variables.constant", "ConstantVariable", CHECKED,
           "capture reads argument kinds from Dynamo's variable trackers"),
    Symbol("UserFunctionVariable", "torch._dynamo.variables.functions", "UserFunctionVariable", CHECKED,
           "capture recognises a repeated body by its function variable"),
    Symbol("TupleVariable", "torch._dynamo.variables.lists", "TupleVariable", CHECKED,
           "capture reads argument kinds from Dynamo's variable trackers"),
    Symbol("TensorVariable", "torch._dynamo.variables.tensor", "TensorVariable", CHECKED,
           "capture reads argument kinds from Dynamo's variable trackers"),
    Symbol("UserDefinedObjectVariable", "torch._dynamo.variables.user_defined", "UserDefinedObjectVariable",
           CHECKED, "capture reads placements and meshes passed as arguments"),
    Symbol("invoke_subgraph_placeholder", "torch._higher_order_ops.invoke_subgraph",
           "invoke_subgraph_placeholder", CHECKED, "the repeated calls of a region run one invoke_subgraph traced once"),
    # --- AOTAutograd and Inductor (imported only when compiling) --------------------------
    Symbol("aot_module_simplified", "torch._functorch.aot_autograd", "aot_module_simplified", CHECKED,
           "the inner compilers run AOTAutograd on the lowered graph"),
    Symbol("functorch_config", "torch._functorch.config", None, CHECKED,
           "scoped AOT settings (config.patch) and the donated_buffer flag"),
    Symbol("OutputType", "torch._functorch._aot_autograd.schemas", "OutputType", CHECKED,
           "a layer whose output aliases an input or another output keeps AOTAutograd's runtime"),
    Symbol("PlainTensorMeta", "torch._functorch._aot_autograd.schemas", "PlainTensorMeta", CHECKED,
           "a layer with a tensor-subclass output keeps AOTAutograd's runtime"),
    Symbol("compile_fx", "torch._inductor.compile_fx", "compile_fx", CHECKED,
           "the inductor inner compiler"),
    Symbol("inductor_cache_dir", "torch._inductor.runtime.cache_dir_utils", "cache_dir", CHECKED,
           "the cacheable DTensor border's gradient files live beside torch's caches"),
    Symbol("compile_fx_inner", "torch._inductor.compile_fx", "compile_fx_inner", CHECKED,
           "the inductor inner compiler, forward and backward graphs"),
    Symbol("CustomGraphPass", "torch._inductor.custom_graph_pass", "CustomGraphPass", CHECKED,
           "lone ops are found after Inductor's post-grad passes (config post_grad_custom_post_pass, "
           "with fallback_by_default; passes/lone_ops.py)"),
    Symbol("get_hash_for_files", "torch._inductor.custom_graph_pass", "get_hash_for_files", CHECKED,
           "the lone-op pass's cache uuid: the hash of its source file"),
    Symbol("select_decomp_table", "torch._inductor.decomposition", "select_decomp_table", CHECKED,
           "Inductor's decomposition table: AOTAutograd gets it without the pointwise ops decomposed late "
           "(passes/late_decompositions.py), and those are decomposed with it"),
    Symbol("inductor_lowerings", "torch._inductor.lowering", "lowerings", CHECKED,
           "an op Inductor lowers itself is never held back from AOTAutograd's decompositions"),
    Symbol("enable_python_dispatcher", "torch._dispatch.python", "enable_python_dispatcher", CHECKED,
           "a late decomposition is traced as Inductor traces its patterns"),
    Symbol("FxGraphCache", "torch._inductor.codecache", "FxGraphCache", CHECKED,
           "a compiled layer restored in a new process loads its graphs by the keys its first compile got"),
    Symbol("CompiledFxGraphConstants", "torch._inductor.output_code", "CompiledFxGraphConstants", CHECKED,
           "what loading a graph from Inductor's cache and its post_compile are given"),
    Symbol("BoxedBool", "torch._inductor.utils", "BoxedBool", CHECKED,
           "post_compile of a graph loaded from Inductor's cache reads cudagraphs as one"),
    Symbol("CompiledTritonKernels", "torch._inductor.async_compile", "CompiledTritonKernels", CHECKED,
           "cleared before a graph is loaded from Inductor's cache, as AOTAutogradCache does"),
    Symbol("TracingContext", "torch._guards", "TracingContext", CHECKED,
           "a layer is compiled under its own tracing context; its fw_metadata is read from it"),
    Symbol("tracing", "torch._guards", "tracing", CHECKED,
           "a layer is compiled under its own tracing context"),
    Symbol("CompileContext", "torch._guards", "CompileContext", CHECKED,
           "the dump names a frame by Dynamo's compile id"),
    Symbol("detect_fake_mode", "torch._guards", "detect_fake_mode", CHECKED,
           "analyses reuse the fake mode of a graph's example values"),
    # --- logging ---------------------------------------------------------------------------
    Symbol("getArtifactLogger", "torch._logging", "getArtifactLogger", CHECKED,
           "our log artifact is enabled by TORCH_LOGS like torch's own"),
    Symbol("trace_structured", "torch._logging", "trace_structured", CHECKED,
           "dump artifacts also go to tlparse's structured trace"),
    Symbol("log_registry", "torch._logging._internal", "log_registry", CHECKED,
           "our log name is registered only once"),
    Symbol("register_artifact", "torch._logging._internal", "register_artifact", CHECKED,
           "TORCH_LOGS=+localmap_fx_regions names our artifact"),
    Symbol("register_log", "torch._logging._internal", "register_log", CHECKED,
           "TORCH_LOGS=localmap_fx names our logger"),
    Symbol("trace_log", "torch._logging._internal", "trace_log", CHECKED,
           "structured artifacts are built only when a trace is being written"),
    # --- ops, fake tensors, dispatch ---------------------------------------------------------
    Symbol("HigherOrderOperator", "torch._ops", "HigherOrderOperator", CHECKED,
           "the collective table looks inside the subgraphs a higher-order op calls"),
    Symbol("OpOverload", "torch._ops", "OpOverload", CHECKED,
           "node targets are told apart by kind to read their schema"),
    Symbol("OpOverloadPacket", "torch._ops", "OpOverloadPacket", CHECKED,
           "node targets are told apart by kind to read their schema"),
    Symbol("FakeTensor", "torch._subclasses.fake_tensor", "FakeTensor", CHECKED,
           "a graph's example values are fake tensors"),
    Symbol("FakeTensorMode", "torch._subclasses.fake_tensor", "FakeTensorMode", CHECKED,
           "analyses and the SPMD check run a body on fake tensors"),
    Symbol("TorchDispatchMode", "torch.utils._python_dispatch", "TorchDispatchMode", CHECKED,
           "find_effects and the global check watch every aten op a body runs"),
    Symbol("disable_current_modes", "torch.utils._python_dispatch", "_disable_current_modes", CHECKED,
           "the DTensor oracle runs outside the global check's own mode"),
    Symbol("is_traceable_wrapper_subclass", "torch.utils._python_dispatch", "is_traceable_wrapper_subclass",
           CHECKED, "a compiled layer refuses tensor subclasses among its inputs"),
    Symbol("DebugMode", "torch.utils._debug_mode", "DebugMode", CHECKED,
           "the global check records DTensor's own propagation as its oracle"),
    Symbol("is_setup_context_defined", "torch.autograd.function", "_is_setup_context_defined", CHECKED,
           "which autograd.Function a traced apply is depends on its setup_context style"),
    Symbol("is_torch_function_mode_enabled", "torch.overrides", "_is_torch_function_mode_enabled", CHECKED,
           "a call that is not ours goes on to the next torch-function mode, as torch dispatches it"),
    Symbol("is_view_op", "torch.fx.passes.reinplace", "_is_view_op", CHECKED,
           "torch's own view-op test, so hoisting agrees with functionalization"),
    # --- pytree ------------------------------------------------------------------------------
    Symbol("pytree", "torch.utils._pytree", None, CHECKED,
           "torch's pytree: the flavour local_map uses without optree, and tree_map"),
    Symbol("cxx_pytree", "torch.utils._cxx_pytree", None, CHECKED,
           "the flavour torch's local_map flattens args with when optree is installed", needs="optree"),
    # --- distributed ---------------------------------------------------------------------------
    Symbol("funcol", "torch.distributed._functional_collectives", None, CHECKED,
           "the functional collectives a body may call (the MoE test model)"),
    Symbol("AsyncCollectiveTensor", "torch.distributed._functional_collectives", "AsyncCollectiveTensor",
           CHECKED, "outputs of functional collectives are waited on at a region's exit"),
    Symbol("get_local_tensor_mode_list", "torch.distributed._local_tensor", "get_local_tensor_mode_list",
           CHECKED, "capture does not reuse a traced body under LocalTensorMode (no invoke_subgraph rule for it)"),
    Symbol("maybe_disable_local_tensor_mode", "torch.distributed._local_tensor",
           "maybe_disable_local_tensor_mode", CHECKED, "the DTensor oracle runs outside LocalTensorMode"),
    Symbol("is_spmd_types_available", "torch.distributed", "_is_spmd_types_available", CHECKED,
           "spmd_types=True needs the package exactly when torch's local_map does"),
    Symbol("resolve_process_group", "torch.distributed.distributed_c10d", "_resolve_process_group", CHECKED,
           "a collective's group name becomes the mesh axis it runs over"),
    Symbol("ToTorchTensor", f"{_DT}._api", "_ToTorchTensor", CHECKED,
           "eager to_local with grad placements, without DTensor.to_local's argument handling"),
    Symbol("FromTorchTensor", f"{_DT}._api", "_FromTorchTensor", CHECKED,
           "eager from_local with a known global shape, without DTensor.from_local's checks"),
    Symbol("normalize_placements_for_grad", f"{_DT}._api", "_normalize_placements_for_grad", CHECKED,
           "gradient placements are normalised as DTensor's to_local does"),
    Symbol("dtensor_from_local", f"{_DT}._api", "from_local", CHECKED,
           "Dynamo records DTensor.from_local as this function"),
    Symbol("DTensorSpec", f"{_DT}._dtensor_spec", "DTensorSpec", CHECKED,
           "redistribute plans and DTensor borders are built from specs"),
    Symbol("TensorMeta", f"{_DT}._dtensor_spec", "TensorMeta", CHECKED,
           "a DTensorSpec needs the global shape, stride and dtype"),
    Symbol("gen_transform_infos_non_cached", f"{_DT}._redistribute", "_gen_transform_infos_non_cached",
           CHECKED, "DTensor's redistribute planner, uncached so no mesh is kept alive"),
    Symbol("redistribute_local_tensor", f"{_DT}._redistribute", "redistribute_local_tensor", CHECKED,
           "the lean border turns a Replicate gradient into the Partial its backward was compiled for, "
           "as DTensor's own backward does (DTensor.redistribute refuses Replicate -> Partial)"),
    Symbol("assert_no_mixed_partial_types", f"{_DT}._utils", "assert_no_mixed_partial_types", CHECKED,
           "eager from_local rejects what DTensor.from_local rejects"),
    Symbol("compute_global_tensor_info", f"{_DT}._utils", "compute_global_tensor_info", CHECKED,
           "eager from_local computes the global shape as DTensor.from_local does"),
    Symbol("StridedShard", f"{_DT}.placement_types", "_StridedShard", CHECKED,
           "negative shard dims are normalised for _StridedShard as for Shard; the cacheable border "
           "writes it as a constant"),
)

PRIVATE_ATTRIBUTES: tuple[PrivateAttribute, ...] = (
    PrivateAttribute("_local_tensor", f"{_DT}.DTensor", CHECKED,
                     "the local shard without DTensor.to_local's autograd node (no grad, fake values)"),
    PrivateAttribute("_spec", f"{_DT}.DTensor", CHECKED, "an argument's mesh and placements in one read"),
    PrivateAttribute("_is_param", "torch.nn.Parameter", CHECKED,
                     "a tensor subclass made a Parameter (a DTensor weight) carries it; eager's fast path "
                     "leaves those to the full path"),
    PrivateAttribute("_dim_group_names", "torch.distributed.device_mesh.DeviceMesh", CHECKED,
                     "a mesh's process groups are part of its structural key"),
    PrivateAttribute("_schema", "torch._ops.OpOverload", CHECKED, "an op's arguments by schema name"),
    PrivateAttribute("_opname", "torch._ops.OpOverload", CHECKED, "a collective's short name in the dump"),
    PrivateAttribute("_qualified_op_name", "torch._ops.OpOverloadPacket", CHECKED,
                     "a packet's name without resolving an overload"),
    PrivateAttribute("_is_view", "torch.Tensor", CHECKED, "a compiled layer's outputs that are views"),
    PrivateAttribute("_fx_graph_cache_key", "torch._inductor.output_code.OutputCode", CHECKED,
                     "the key a compiled AOT graph has in Inductor's FX graph cache (what AOTAutogradCache "
                     "stores too), kept so a new process loads it without tracing"),
    PrivateAttribute("_fx_graph_cache_debug_lines", "torch._inductor.output_code.OutputCode", CHECKED,
                     "stored with that key, as AOTAutogradCache does"),
    PrivateAttribute("_i_will_not_complain_if_bc_breaks_InstructionTranslator",
                     "torch._dynamo.comptime.ComptimeContext", CHECKED,
                     "capture reads the traced frame's locals"),
    PrivateAttribute("_i_will_not_complain_if_bc_breaks_VariableTracker", "torch._dynamo.comptime.ComptimeVar",
                     CHECKED, "capture reads a value Dynamo holds as a constant"),
)

_BY_NAME = {s.name: s for s in SYMBOLS}
__all__ = ["CHECKED", "PRIVATE_ATTRIBUTES", "SYMBOLS", "PrivateAttribute", "Symbol", *sorted(_BY_NAME)]


def __getattr__(name: str) -> Any:
    row = _BY_NAME.get(name)
    if row is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = row.resolve()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_BY_NAME))


if TYPE_CHECKING:
    import torch._functorch.config as functorch_config
    import torch.distributed._functional_collectives as funcol
    import torch.utils._cxx_pytree as cxx_pytree
    import torch.utils._pytree as pytree
    from torch._C import DisableTorchFunction
    from torch._C import _AutoDispatchBelowAutograd as AutoDispatchBelowAutograd
    from torch._C._autograd import _get_current_graph_task_keep_graph as get_current_graph_task_keep_graph
    from torch._C._distributed_c10d import _get_work_registry_size as get_work_registry_size
    from torch._dynamo import assume_constant_result, skip_frame
    from torch._dynamo.backends.registry import _BACKENDS as registered_backends
    from torch._dynamo.backends.registry import register_backend
    from torch._dynamo.comptime import comptime
    from torch._dynamo.exc import ShortenTraceback
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.utils import counters as dynamo_counters
    from torch._dynamo.utils import get_static_address_type
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.functions import UserFunctionVariable
    from torch._dynamo.variables.lists import TupleVariable
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable
    from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import CompileContext, TracingContext, detect_fake_mode, tracing
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph_placeholder
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import CompiledTritonKernels
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool
    from torch._logging import getArtifactLogger, trace_structured
    from torch._logging._internal import log_registry, register_artifact, register_log, trace_log
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.autograd.function import _is_setup_context_defined as is_setup_context_defined
    from torch.distributed import _is_spmd_types_available as is_spmd_types_available
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._local_tensor import get_local_tensor_mode_list, maybe_disable_local_tensor_mode
    from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
    from torch.distributed.tensor._api import _FromTorchTensor as FromTorchTensor
    from torch.distributed.tensor._api import _normalize_placements_for_grad as normalize_placements_for_grad
    from torch.distributed.tensor._api import _ToTorchTensor as ToTorchTensor
    from torch.distributed.tensor._api import from_local as dtensor_from_local
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import (
        _gen_transform_infos_non_cached as gen_transform_infos_non_cached,
    )
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor._utils import assert_no_mixed_partial_types, compute_global_tensor_info
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
    from torch.fx.passes.reinplace import _is_view_op as is_view_op
    from torch.overrides import _is_torch_function_mode_enabled as is_torch_function_mode_enabled
    from torch.utils._debug_mode import DebugMode
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
