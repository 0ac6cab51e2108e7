"""Quantized ``nn.Linear`` layers served by the tuner: ``tuner.torch.quantize_linear``.

    import tuner.torch
    model = tuner.torch.quantize_linear(model, "int4")    # or "fp8"
    y = model(x)                                           # tuner.int4_linear / tuner.scaled_mm

Each replaced layer quantizes its weight once, at replacement, and keeps only the packed form:

- ``int4``: asymmetric per-group weights (``tuner.quant.int4``) in torch's packed format for the
  weight's device (the tile-packed int32 tensor on CUDA, torch's [N, K / 2] uint8 on the CPU),
  with torch's ``scales_and_zeros``; the forward is ``int4_linear``. The weight is packed
  by ``int4_torch.torch_pack``, which keeps our layout of it too, so the Triton W4A16 kernel
  serves it with no conversion;
- ``fp8``: e4m3 weights with a scale per output row; the forward quantizes the activations per
  row, per call, and runs ``scaled_mm`` (rowwise scales).

Their calls go to the dispatcher of the innermost open ``tuner.torch.enabled()`` block (its
winners, its stats), as the torch ops routed there do, and outside any to the process-wide one
(that of ``tuner.int4_linear`` and ``tuner.scaled_mm``).

Both compute in bf16, the activation type the formats' kernels take, and return the input's
dtype; a dtype cast of the model (``model.half()``, ``model.to(torch.float32)``) leaves their
quantized weights, scales and bias as they are, while a move to another device moves them (an
int4 weight is repacked for the new kind of device, as is one loaded from another's). A
layer whose shape the format cannot hold (an empty one included), an int4 one on the meta device
(no values to pack), a subclass of ``nn.Linear``, or a layer of a module that reads its
children's ``weight`` itself (torch's attention and transformer layers, for their fused paths)
stays as it was and is listed in ``module.quantized_skipped`` beside ``module.quantized_layers``
(the replaced ones).
They are for inference: like torch's int4 and FP8 ops, they have no backward.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
from torch import nn

from tuner.core import tensor_memo
from tuner.core.keys import fp8_shape_error
from tuner.quant import fp8, int4, int4_torch
from tuner.serving import dispatcher

log = logging.getLogger(__name__)

FORMATS = ("int4", "fp8")
DEFAULT_GROUP = 128  # K elements sharing an int4 scale and zero, as torch's INT4 recipes use
COMPUTE_DTYPE = torch.bfloat16
# modules that read their linear children's weight themselves (their fused fast paths)
READS_CHILD_WEIGHTS = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def unsupported(fmt: str, weight: torch.Tensor, group_size: int | None) -> str | None:
    """Why an [N, K] weight (on its device) cannot take ``fmt``, or None when it can."""
    n, k = weight.shape
    if not n or not k:  # nn.Linear serves it as it is; the formats' quantizers fail on it
        return f"the weight is empty (N={n}, K={k}): nothing to quantize"
    if fmt == "int4":
        if weight.is_meta:  # torch's packer reads the values; FP8's quantization stays symbolic
            return "int4 packing needs the weight's values, and it is on the meta device"
        try:
            int4.check_group_size(group_size, k)
        except ValueError as e:
            fits = [g for g in int4.GROUP_SIZES if k % g == 0]
            return f"{e}" + (f" (group_size={fits[-1]} fits this layer)" if fits else "")
        multiple = int4_torch.n_multiple(weight.device)
        if n % multiple:
            return f"int4 packing on {weight.device.type} needs N % {multiple} == 0 (N={n}, K={k})"
        return None
    return fp8_shape_error(n, k)


def _bias(linear: nn.Linear) -> nn.Parameter | None:
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().to(COMPUTE_DTYPE), requires_grad=False)


# what nn.Linear computes in: it refuses other inputs, and so do the quantized layers
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_activation(x: torch.Tensor, in_features: int, device: torch.device) -> None:
    """ValueError naming the field unless ``x`` is a [..., in_features] of ``ACTIVATION_DTYPES``
    on the layer's ``device``: an integer one would come back truncated, an FP8 one fail inside
    the quantization of the activations (or come back rounded to FP8), one on another device
    fail inside the op, naming operands the caller never passed."""
    if x.device != device:
        raise ValueError(f"x.device={x.device}: the layer's weights are on {device}; move x "
                         f"there, or the model to {x.device} (model.to(x.device))")  # fmt: skip
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x.dtype={x.dtype}: expected a floating-point activation, one of "
                         f"{', '.join(map(str, ACTIVATION_DTYPES))}")  # fmt: skip
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x.shape={tuple(x.shape)}: expected [..., in_features={in_features}]")


# --- what torch.compile sees: the layers' GEMMs as opaque custom ops (traced, the dispatcher's
# first-call set-up, config files included, would break the graph) ---------------------------


@torch.library.custom_op("tuner::int4_linear", mutates_args=())
def _int4_linear_op(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    disp = dispatcher.active_dispatcher()
    return disp.int4_linear(x, packed, scales_and_zeros, group_size).contiguous()


@_int4_linear_op.register_fake
def _int4_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scales_and_zeros.shape[1]))


@torch.library.custom_op("tuner::scaled_mm", mutates_args=())
def _scaled_mm_op(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    disp = dispatcher.active_dispatcher()
    return disp.scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype).contiguous()


@_scaled_mm_op.register_fake
def _scaled_mm_fake(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _int4_linear() -> Callable[..., torch.Tensor]:
    """The custom op while torch.compile traces; eagerly the dispatcher (no op overhead): the
    innermost ``tuner.torch.enabled()`` block's, as for the torch ops it routes, else the
    process-wide one."""
    if torch.compiler.is_compiling():
        return torch.ops.tuner.int4_linear
    return dispatcher.active_dispatcher().int4_linear


def _scaled_mm() -> Callable[..., torch.Tensor]:
    if torch.compiler.is_compiling():
        return torch.ops.tuner.scaled_mm
    return dispatcher.active_dispatcher().scaled_mm


class QuantizedLinear(nn.Module):
    """What the quantized layers share: a dtype cast of the model keeps their tensors' dtypes
    (the packed weight and its scales are the format, and the forward computes in
    ``COMPUTE_DTYPE`` whatever the activation's dtype); device moves apply."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        before = {name: t.data for name, t in [*self._parameters.items(), *self._buffers.items()]
                  if t is not None}  # fmt: skip
        super()._apply(fn, recurse)
        for name, old in before.items():
            if name in self._parameters:
                param = self._parameters[name]
                if param.dtype != old.dtype:
                    param.data = old.to(device=param.device)
            elif self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(device=self._buffers[name].device)
        return self


class Int4Linear(QuantizedLinear):
    """``y = x @ W.T + b`` with W held as torch-packed int4 and per-group scales and zeros."""

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        q, scales_and_zeros = int4.quantize(linear.weight.detach().to(COMPUTE_DTYPE), group_size)
        self.register_buffer("packed_weight", int4_torch.torch_pack(q))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = _bias(linear)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """A move to another kind of device repacks the weight: torch packs int4 its own way
        on each (``int4_torch``), and a CPU packing moved to a GPU is no GPU packing. Repacked
        before anything moves: a shape the other device cannot pack raises with the layer
        whole where it was. The meta device holds no values: a move there takes the packing as
        it is, and one from there (``to_empty``) makes the target's packing of zeros, for a state
        dict to load into."""
        before = self.packed_weight
        target = fn(before[:0]).device  # where the move takes it (an empty tensor: no copy)
        repacked = None
        if before.is_meta and target.type != "meta":
            zeros = torch.zeros(self.out_features, self.in_features, dtype=torch.uint8)
            repacked = int4_torch.torch_pack(zeros.to(target))
        elif target.type not in (before.device.type, "meta"):
            repacked = _repacked(before, target)
        super()._apply(fn, recurse)
        if repacked is not None:
            self.packed_weight = repacked
        return self

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        """A state dict saved from the layer on another kind of device holds that device's
        packing (``_apply``): it is repacked for this one before it is loaded. Loaded in place
        into tensors made under ``torch.inference_mode()``, which keep no version: what the
        kernels' memos made of the old values is dropped (``tensor_memo.forget``)."""
        name = prefix + "packed_weight"
        saved = state_dict.get(name)
        if isinstance(saved, torch.Tensor) and saved.dtype != self.packed_weight.dtype:
            state_dict[name] = _repacked(_on_its_device(saved, name), self.packed_weight.device)
        super()._load_from_state_dict(state_dict, prefix, *args)
        for t in (self.packed_weight, self.scales_and_zeros):
            if t.is_inference():  # others' in-place writes bump their version
                tensor_memo.forget(t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, self.in_features, self.packed_weight.device)
        # any strides, as nn.Linear takes them (a sequence's last token: h[:, -1, :])
        y = _int4_linear()(
            x.to(COMPUTE_DTYPE).contiguous(), self.packed_weight, self.scales_and_zeros,
            self.group_size,
        )  # fmt: skip
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}"


def _repacked(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """torch's int4 packing, for ``device``, of the values ``packed`` holds in the packing of
    the device it is on."""
    return int4_torch.torch_pack(int4_torch.nibbles(packed).to(device))


def _on_its_device(packed: torch.Tensor, name: str) -> torch.Tensor:
    """``packed`` where its packing can be read: torch's uint8 CPU packing on the CPU, its int32
    tile packing on a GPU (a state dict loaded with ``map_location="cpu"`` holds one there)."""
    if packed.dtype == torch.uint8:
        return packed.cpu()
    if packed.is_cuda:
        return packed
    if not torch.cuda.is_available():
        raise ValueError(
            f"{name}: the state dict holds torch's int4 packing for CUDA (int32 tiles), "
            "which only a GPU can read; load it on a machine with one, or quantize the float "
            "weights here"
        )
    return packed.cuda()


class Fp8Linear(QuantizedLinear):
    """``y = x @ W.T + b`` with W held as e4m3 with a scale per output row; the activations are
    quantized per row on every call (their range changes with every input)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = fp8.quantize_rowwise(linear.weight.detach())
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)  # [N, 1]; _scaled_mm takes its [1, N] view
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, self.in_features, self.weight.device)
        if x.numel() == 0:  # no rows (an expert that got no tokens): no scales to make
            return x.new_empty(*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features)
        xq, x_scale = fp8.quantize_rowwise(x2)
        y = _scaled_mm()(
            xq, self.weight.t(), x_scale, self.weight_scale.t(), out_dtype=COMPUTE_DTYPE
        )
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 rowwise"


def _format_hint(fmt: object) -> str:
    """What to pass instead of a model config's dtype name (``int4-g128``, ``fp8-rowwise``), which
    is the spelling a user who tunes with model configs has at hand."""
    if not isinstance(fmt, str):
        return ""
    head, _, rest = fmt.partition("-")
    if head == "int4" and rest.startswith("g") and rest[1:].isdigit():
        return f" (a model config's name: pass 'int4' and group_size={rest[1:]})"
    if head == "fp8" and rest:
        return " (a model config's name: pass 'fp8', whose scales are rowwise)"
    return ""


def quantize_linear(module: nn.Module, fmt: str, group_size: int | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` (``module`` itself included) by a quantized
    layer of format ``fmt`` (``"int4"`` or ``"fp8"``) served by the tuner; returns the module.

    ``group_size``: int4 only (default ``DEFAULT_GROUP``), the number of K elements that share a
    scale and zero (``tuner.quant.int4.GROUP_SIZES``). Layers the format cannot hold (see the
    module's docstring) are left as they are, with a warning in the log:
    ``module.quantized_skipped`` maps their names to the reason, and ``module.quantized_layers``
    lists the replaced ones.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}{_format_hint(fmt)}")
    if fmt == "fp8" and group_size is not None:  # rowwise scales: no groups to size
        raise ValueError(f"group_size={group_size!r}: int4 only (fp8 scales are per row)")
    if fmt == "int4":  # each layer's K: unsupported()
        group_size = DEFAULT_GROUP if group_size is None else group_size
        int4.check_group(group_size)
        group_size = operator.index(group_size)  # a NumPy int's value: the custom op takes an int
    if isinstance(module, nn.Linear):  # a bare layer: nothing to leave in place
        reason = kept_reason(module, None) or unsupported(fmt, module.weight, group_size)
        if reason:
            raise ValueError(f"module: {reason}")
        return _quantized(module, fmt, group_size)
    # every name of each layer: one reached by two names (a shared, tied layer) is quantized
    # once and set at both, or left at both
    layers: dict[int, tuple[nn.Linear, list[tuple[str, nn.Module, str]]]] = {}
    for name, child in module.named_modules(remove_duplicate=False):
        if isinstance(child, nn.Linear) and name:
            parent_name, _, attr = name.rpartition(".")
            place = (name, module.get_submodule(parent_name), attr)
            layers.setdefault(id(child), (child, []))[1].append(place)
    replaced: list[str] = []
    skipped: dict[str, str] = {}
    for child, places in layers.values():
        kept = {name: r for name, parent, _ in places if (r := kept_reason(child, parent))}
        # a kept layer's weight may have no shape yet (an uninitialized nn.LazyLinear)
        shape = None if kept else unsupported(fmt, child.weight, group_size)
        if kept or shape:
            first = next(iter(kept.items()), None)
            for name, _, _ in places:
                skipped[name] = kept.get(name) or shape or f"shared with {first[0]}: {first[1]}"
            continue
        quantized = _quantized(child, fmt, group_size)
        for name, parent, attr in places:
            setattr(parent, attr, quantized)
            replaced.append(name)
    for name, reason in skipped.items():
        log.warning("quantize_linear: %s left as it was: %s", name, reason)
    earlier = [name for name, child in module.named_modules(remove_duplicate=False)
               if isinstance(child, QuantizedLinear) and name not in replaced]  # fmt: skip
    if not replaced and not skipped:
        log.warning("quantize_linear: no nn.Linear layer in %s to quantize%s",
                    type(module).__name__,
                    f" ({len(earlier)} quantized already)" if earlier else "")  # fmt: skip
    module.quantized_layers = earlier + replaced
    module.quantized_skipped = skipped
    return module


def kept_reason(linear: nn.Linear, parent: nn.Module | None) -> str | None:
    """Why a layer is left in place although its shape fits: its parent reads its ``weight``
    itself, which a quantized layer has not (torch's attention and transformer layers, for their
    fused paths), or it is a subclass of ``nn.Linear``, whose parent may (``nn.MultiheadAttention``
    reads its ``out_proj``'s)."""
    if isinstance(parent, READS_CHILD_WEIGHTS):
        return f"its parent {type(parent).__name__} reads the layer's weight itself (fused path)"
    if type(linear) is not nn.Linear:
        return (f"{type(linear).__name__} is a subclass of nn.Linear, whose parent may read its "
                "weight directly (as nn.MultiheadAttention does its out_proj's)")  # fmt: skip
    return None


def _quantized(linear: nn.Linear, fmt: str, group_size: int | None) -> nn.Module:
    return Int4Linear(linear, group_size) if fmt == "int4" else Fp8Linear(linear)
