"""The ``dequant_gemm`` source: its dequantization pass bit for bit against
``int4.dequantize`` rounded to the activation dtype, its params refused by name, its runner
through the INT4 numerics gate (chunked or whole, planted wrong results outside the bound), its
keys and shortlist; on the GPU, the output written in place with the scratch as the only
allocation, a CUDA graph, and a planted wrong candidate rejected by the tuning engine. CPU:
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.candidates.gate import tune_uncut
from tuner.candidates import dequant_gemm as dg
from tuner.candidates import registry
from tuner.candidates.triton_kernels import dequant
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant import int4, int4_torch

HAS_GPU = torch.cuda.is_available()


def key_of(spec: str, m: int, n: int, k: int, dtype: str | None = None) -> GemmKey:
    fields = lowbit_fields(spec)
    if dtype:
        fields.update(dtype=dtype, out_dtype=dtype)
    return GemmKey(m=m, n=n, k=k, **fields)


# (n, k, group, dtype, rows a chunk, bn): a ragged last block (200, 240, 130), chunk starts
# past 0, programs over part of a block (32), one block (64) and two (128), all four groups
ROW_CASES = [
    (200, 384, 128, torch.bfloat16, 128, 64),
    (240, 256, 32, torch.float16, 64, 32),
    (192, 256, 64, torch.bfloat16, 192, 128),
    (130, 128, 128, torch.bfloat16, 130, 64),
    (320, 512, 256, torch.float16, 256, 128),
]


def _rows_bit_for_bit(n, k, group, dtype, rows, bn, device) -> None:
    gen = torch.Generator(device).manual_seed(n + k)
    w = torch.randn(n, k, generator=gen, device=device).to(dtype)
    q, sz = int4.quantize(w, group)
    ref = int4.dequantize(q, sz, group).to(dtype)
    packed, fill = int4.pack(q), dequant.Dequantizer(n, k, group, rows, bn)
    for start in range(0, n, rows):
        out = torch.full((min(rows, n - start), k), float("nan"), dtype=dtype, device=device)
        fill(packed, sz, out, start)
        assert torch.equal(out, ref[start : start + out.shape[0]]), (start, out.shape)


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path; GPU hosts run the GPU test")
@pytest.mark.parametrize(("n", "k", "group", "dtype", "rows", "bn"), ROW_CASES)
def test_dequantized_rows_equal_the_reference_bit_for_bit(n, k, group, dtype, rows, bn) -> None:
    _rows_bit_for_bit(n, k, group, dtype, rows, bn, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "group", "dtype", "rows", "bn"), ROW_CASES)
def test_gpu_dequantized_rows_equal_the_reference_bit_for_bit(n, k, group, dtype, rows, bn):
    """Equal bit for bit: (q - 8) x scale is exact in fp32 (4 bits times a 16-bit mantissa), so
    the kernel's fused multiply-add and the reference's multiply, then add, both round the sum
    to fp32 once and then to the dtype once."""
    _rows_bit_for_bit(n, k, group, dtype, rows, bn, "cuda")


def test_bad_params_and_calls_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="'chunks'=0"):
        dg.check_params({"chunks": 0}, 1024)
    with pytest.raises(ValueError, match="'chunks'='2'"):
        dg.check_params({"chunks": "2"}, 1024)
    with pytest.raises(ValueError, match=r"'chunks'=5: allowed an int in 1\.\.4"):
        dg.check_params({"chunks": 5}, 1024)
    with pytest.raises(ValueError, match=r"'chunks'=3: .* splits into 2 chunks of 512 rows"):
        dg.check_params({"chunks": 3}, 1024)
    with pytest.raises(ValueError, match=r"'bn': bn=48: allowed \(32, 64, 128\)"):
        dg.check_params({"chunks": 1, "bn": 48}, 1024)
    with pytest.raises(ValueError, match="param 'tile': unknown"):
        dg.check_params({"chunks": 1, "tile": 64}, 1024)
    assert dg.check_params({"chunks": 4, "bn": 128}, 1024) == (4, 128)
    with pytest.raises(ValueError, match="rows=100"):
        dequant.Dequantizer(1024, 256, 128, 100, 64)
    fill = dequant.Dequantizer(1024, 256, 128, 256, 64)
    weight = torch.zeros(1024, 128, dtype=torch.uint8)
    sz = torch.zeros(2, 1024, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="start=32"):
        fill(weight, sz, torch.empty(256, 256, dtype=torch.bfloat16), 32)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \[rows, K=256\]"):
        fill(weight, sz, torch.empty(256, 256, dtype=torch.float32), 0)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \[rows, K=256\]"):
        fill(
            weight, sz, torch.empty(128, 128, dtype=torch.bfloat16), 0
        )  # too narrow: never written
    with pytest.raises(ValueError, match="start=-64"):
        fill(weight, sz, torch.empty(64, 256, dtype=torch.bfloat16), -64)
    with pytest.raises(ValueError, match=r"weight: expected a contiguous uint8 \[1024, 128\]"):
        fill(weight[:512], sz, torch.empty(256, 256, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match=r"scales_and_zeros\.dtype"):
        fill(weight, sz.half(), torch.empty(256, 256, dtype=torch.bfloat16), 0)
    key = key_of("int4-g128", 64, 512, 256)
    x, packed, scales = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    run = dg.DequantGemm().build(key, {"chunks": 1, "bn": 64})
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        run(x, packed, scales[:1].contiguous())
    with pytest.raises(ValueError, match=r"x\.dtype"):
        run(x.float(), packed, scales)
    with pytest.raises(ValueError, match=r"built for \(M, N, K\)=\(64, 512, 256\)"):
        run(x[:32], packed, scales)
    assert dg.shortlist(256, 200, 131072, 50 * 2**20, 132) == [{"chunks": 1, "bn": 64}]


def test_keys_it_takes_and_its_shortlist() -> None:
    src = dg.DequantGemm()
    assert src.unsupported(key_of("fp8-rowwise", 256, 512, 256)) == "int4 weights only"
    assert "chunks of 128" in src.unsupported(key_of("int4-g32", 256, 512, 96))
    assert f"below {dg.MIN_M} rows" in src.unsupported(key_of("int4-g128", 63, 512, 256))
    assert src.unsupported(key_of("int4-g128", 64, 512, 256, dtype="f16")) is None
    l2 = 50 * 2**20
    # Qwen2.5-7B qkv at M = 2048: the whole weight, then halves (their scratch under half the L2)
    found = dg.shortlist(2048, 4608, 3584, l2, 132)
    assert found[0] == {"chunks": 1, "bn": dg.DEFAULT_BN} and len(found) == 2
    for params in found[1:]:
        chunks, _ = dg.check_params(params, 4608)
        # the fewest chunks whose scratch fits half the L2
        assert 2 * dg.scratch_bytes(4608, 3584, chunks) <= l2
        assert 2 * dg.scratch_bytes(4608, 3584, chunks - 1) > l2
    # at M = 256 a chunk's GEMM would leave most SMs idle: the whole weight only
    assert dg.shortlist(256, 4608, 3584, l2, 132) == found[:1]
    assert registry.BUILTIN["dequant_gemm"] == "tuner.candidates.dequant_gemm:DequantGemm"


# (spec, m, n, k, dtype, chunks): whole, two chunks, two with a short last one (N = 1008:
# 512 + 496 rows, a ragged block of 48)
GATE_CASES = [
    ("int4-g128", 64, 512, 256, None, 1),
    ("int4-g32", 70, 512, 256, "f16", 2),
    ("int4-g64", 65, 1008, 256, None, 2),
]


def _run_through_the_gate(spec, m, n, k, dtype, chunks, device) -> None:
    key = key_of(spec, m, n, k, dtype)
    x, packed, sz = samples.make_inputs(key, device, torch.Generator(device).manual_seed(m))
    ref = samples.reference(key, (x, packed, sz))
    run = dg.DequantGemm().build(key, {"chunks": chunks, "bn": dg.DEFAULT_BN})
    out = samples.output_like(key, (x, packed, sz))
    assert run(x, packed, sz, out=out) is out
    assert samples.relative_error(out, ref) <= 1
    # planted: nibbles of each pair swapped, the neighbouring group's scales
    q = int4_torch.nibbles(packed)
    swapped = int4_torch.torch_pack(q.reshape(n, -1, 2).flip(-1).reshape(n, k))
    assert samples.relative_error(run(x, swapped, sz), ref) > 1
    assert samples.relative_error(run(x, packed, sz.roll(1, dims=0).contiguous()), ref) > 1


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path; GPU hosts run the GPU test")
@pytest.mark.parametrize(("spec", "m", "n", "k", "dtype", "chunks"), GATE_CASES)
def test_runner_passes_the_int4_gate_and_planted_errors_fail_it(spec, m, n, k, dtype, chunks):
    _run_through_the_gate(spec, m, n, k, dtype, chunks, "cpu")


class PlantedDequant(dg.DequantGemm):
    """``dequant_gemm`` whose runner reads the neighbouring group's scales: a wrong result."""

    name = "planted_dequant"

    def build(self, key, params):
        run = super().build(key, params)

        def wrong(x, packed, sz, out=None):
            return run(x, packed, sz.roll(1, dims=0).contiguous(), out=out)

        return wrong


def _tune_beside_a_planted_twin(key: GemmKey, device: str):
    registry.register(PlantedDequant())
    try:
        outcome = tune_uncut(key, device, ["dequant_gemm", "planted_dequant"])
    finally:
        registry.unregister("planted_dequant")
    ours = [m for m in outcome.measurements if m.source == "dequant_gemm"]
    planted = [m for m in outcome.measurements if m.source == "planted_dequant"]
    assert ours and all(m.status == "ok" and m.max_rel_err <= 1 for m in ours), ours
    assert planted and all(m.status == "rejected" for m in planted), planted
    assert outcome.winner.source in ("torch_lowbit", "dequant_gemm")


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path; GPU hosts run the GPU test")
def test_tuned_on_the_cpu_beside_a_planted_wrong_twin() -> None:
    _tune_beside_a_planted_twin(key_of("int4-g64", 64, 256, 256), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("spec", "m", "n", "k", "dtype", "chunks"),
    [*GATE_CASES, ("int4-g128", 256, 4608, 3584, None, 2), ("int4-g128", 300, 3584, 1024, "f16", 3),
     ("int4-g256", 2048, 4096, 4096, None, 1)],
)  # fmt: skip
def test_gpu_runner_passes_the_int4_gate(spec, m, n, k, dtype, chunks) -> None:
    _run_through_the_gate(spec, m, n, k, dtype, chunks, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [1, 3])
def test_gpu_output_in_place_scratch_the_only_allocation_and_a_graph(chunks: int) -> None:
    """Each chunk's GEMM writes its column slice of ``out`` without a copy: after a warm-up the
    only allocation of a call is the scratch (``chunk_rows x K x 2`` bytes); replayed in a CUDA
    graph with x changed in place, each replay reads the x of its time."""
    key = key_of("int4-g128", 256, 1536, 1024)
    x, packed, sz = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(7))
    run = dg.DequantGemm().build(key, {"chunks": chunks, "bn": dg.DEFAULT_BN})
    out = samples.output_like(key, (x, packed, sz))
    run(x, packed, sz, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    run(x, packed, sz, out=out)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] - before["allocation.all.allocated"] == 1
    requested = after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"]
    assert requested == dg.scratch_bytes(key.n, key.k, chunks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(x, packed, sz, out=out)
    gen = torch.Generator("cuda").manual_seed(8)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        ref = samples.reference(key, (x, packed, sz))
        assert samples.relative_error(out, ref) <= 1


@pytest.mark.gpu
def test_gpu_tuned_beside_a_planted_wrong_twin() -> None:
    _tune_beside_a_planted_twin(key_of("int4-g128", 256, 4096, 4096), "cuda")
