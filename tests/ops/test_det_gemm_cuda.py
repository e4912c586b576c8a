"""det_gemm's ``cuda`` provider (family ``det_gemm/cuda-sm90``).

CPU (CI): the provider's refusal reasons, its opt-in resolution, the build script, the launch
arguments (captured, nothing runs) of the plain and the split-K products, the split table (off).
GPU (an SM90 device with ``librl_engine_sm90.so`` built, ``scripts/gpu_csrc.sh``): numerics vs
float64, bitwise row invariance over M = 1..8192, every tile config equal, column invariance,
determinism, backward, CUDA graphs, fused == unfused; split-K (forced S, switched off in the
table): row invariance, the partials vs a sliced reference, the reduction order bitwise.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from rl_engine import KernelRegistry, config
from rl_engine.ops import det_gemm, det_gemm_cat
from rl_engine.ops.det_gemm import config as gemm_config
from rl_engine.ops.det_gemm import cuda as gemm_cuda
from rl_engine.registry import BackendUnavailableError
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- CPU: refusals


@pytest.fixture
def fresh_load():
    """The library is looked up again (and forgotten after the test)."""
    gemm_cuda._load.cache_clear()
    yield
    gemm_cuda._load.cache_clear()


def test_refuses_other_devices():
    prov = gemm_cuda.PROVIDER
    assert prov.numerics == "det_gemm/cuda-sm90" and prov.invariant and prov.opt_in
    assert "runs on ['cuda']" in prov.why_not("cpu", triton_interpret=False)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        KernelRegistry.get_op("det_gemm", device="cpu", backend="cuda")


def test_refuses_without_library(monkeypatch, fresh_load, tmp_path):
    monkeypatch.setenv("RL_ENGINE_CSRC_LIB", str(tmp_path / "missing.so"))
    config.reload()
    reason = gemm_cuda.available("cuda", triton_interpret=False)
    assert "is not built" in reason and "build_csrc.sh" in reason, reason
    with pytest.raises(BackendUnavailableError, match="is not built"):
        KernelRegistry.get_op("det_gemm", device="cuda", backend="cuda")


def test_refuses_unloadable_library(monkeypatch, fresh_load, tmp_path):
    bad = tmp_path / gemm_cuda.LIB_NAME
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv("RL_ENGINE_CSRC_LIB", str(bad))
    config.reload()
    assert "cannot load" in gemm_cuda.available("cuda", triton_interpret=False)


def test_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(gemm_cuda, "_load", lambda: (object(), None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gemm_cuda.available("cuda", triton_interpret=False) == "no CUDA device is available"


def test_refuses_other_gpus(monkeypatch):
    monkeypatch.setattr(gemm_cuda, "_load", lambda: (object(), None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    reason = gemm_cuda.available("cuda", triton_interpret=False)
    assert "needs an SM90 GPU" in reason and "sm_80" in reason, reason


def test_pin_raises_with_the_reason(monkeypatch, fresh_load, tmp_path):
    monkeypatch.setenv("RL_ENGINE_CSRC_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", "cuda")
    config.reload()
    with pytest.raises(BackendUnavailableError, match="configuration pin 'cuda'.*is not built"):
        KernelRegistry.get_op("det_gemm", device="cuda")


@pytest.fixture
def runnable_cuda_provider():
    """The cuda provider registered first and always available (resolution only: nothing is
    run)."""
    orig = gemm_cuda.PROVIDER
    always = dataclasses.replace(orig, available=lambda device, *, triton_interpret: None)
    KernelRegistry.register_provider(always, first=True)
    yield always
    KernelRegistry.register_provider(orig)  # back at the end, as det_gemm registers it


def test_opt_in_never_chosen_by_default(runnable_cuda_provider):
    assert KernelRegistry.providers("det_gemm", "cuda")[0].name == "cuda"
    op = KernelRegistry.get_op("det_gemm", device="cuda")
    assert op.provider.name != "cuda"


def test_opt_in_chosen_by_pin(monkeypatch, runnable_cuda_provider):
    monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", "cuda")
    config.reload()
    op = KernelRegistry.get_op("det_gemm", device="cuda")
    assert op.provider.name == "cuda" and op.numerics == "det_gemm/cuda-sm90"
    rec = [r for r in KernelRegistry.report() if r["op"] == "det_gemm"]
    assert rec and rec[0]["numerics"] == "det_gemm/cuda-sm90"


def test_linear_logp_triton_refuses_cuda_gemm(monkeypatch, runnable_cuda_provider):
    import importlib

    ll = importlib.import_module("rl_engine.ops.linear_logp")

    monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", "cuda")
    config.reload()
    with pytest.raises(BackendUnavailableError, match="RL_ENGINE_BACKEND_LINEAR_LOGP=unfused"):
        ll._check_gemm_family("triton", "cuda")
    ll._check_gemm_family("native", "cuda")  # the native provider calls the resolved det_gemm
    ll._check_gemm_family("unfused", "cuda")  # and so does the unfused one


def test_tp_provider_is_opt_in_too():
    (tp,) = [p for p in KernelRegistry.providers("det_gemm_tp") if p.name == "cuda"]
    assert tp.opt_in and tp.numerics == "det_gemm_tp/g8[det_gemm/cuda-sm90]"


def test_cuda_config_table():
    for m in (1, 64, 65, 256, 257, 8192):
        assert gemm_config.get_cuda_config(m, 4096, 4096) in gemm_config.CUDA_CONFIGS
    assert gemm_config.CUDA_WGRAD_CONFIG in gemm_config.CUDA_CONFIGS
    assert set(gemm_config.CUDA_TILES) == set(gemm_config.CUDA_CONFIGS)


def test_cuda_config_indices_match_the_library_header():
    """config.CUDA_CONFIGS names the library's RLE_CFG_* indices (det_gemm_sm90.h) one to one,
    and the header's ABI version is the one the loader requires."""
    header = (ROOT / "csrc" / "det_gemm" / "det_gemm_sm90.h").read_text()
    defined = {
        name.lower(): int(idx) for name, idx in re.findall(r"#define RLE_CFG_(\w+) (\d+)", header)
    }
    assert defined == gemm_config.CUDA_CONFIGS
    (abi,) = re.findall(r"#define RLE_ABI_VERSION (\d+)", header)
    assert int(abi) == gemm_cuda._ABI_VERSION


def test_cuda_config_wave_model():
    """Up to 16 rows `mid`; up to 256 `small` where its tiles fit one wave, else the cheapest of
    `mid` / `mid192` / `large` in the wave model; above, of `large` / `large192` / `square`, and
    `large` as `large_c2` from CUDA_CLUSTER_M rows."""
    get = gemm_config.get_cuda_config
    assert [get(m, 4096, 4096) for m in (1, 16, 17, 64, 65, 128, 129, 256)] == [
        "mid", "mid", "small", "small", "small", "small", "mid", "mid"
    ]  # fmt: skip
    # decode: `mid` at every N
    assert {get(m, n, 4096, 132) for m in (1, 16) for n in (8, 4096, 6144, 28672, 151936)} == {
        "mid"
    }
    # short prefill: `small` while its grid is one wave: 64-column tiles x 64-row blocks
    assert get(64, 8448, 4096, 132) == "small" and get(64, 8449, 4096, 132) != "small"  # 132 / 133
    assert get(128, 6144, 4096, 132) == "mid"  # 2 x 96 small tiles: two waves; 96 mid tiles: one
    assert get(128, 6144, 4096, 264) == "small"  # one wave of twice the SMs
    # N 6144 at M 256: 192 mid tiles (two waves, the second 45% full) vs 128 mid192 tiles (one)
    assert get(256, 6144, 4096, 132) == "mid192"
    # N 28672 at M 128: 448 mid tiles (4 waves of a 0.8-efficient quarter tile) vs 112 large (1)
    assert get(128, 28672, 4096, 132) == "large"
    assert get(64, 151936, 4096, 132) == "mid192" and get(256, 4096, 4096, 132) == "mid"
    # M 512 over N 4096: 64 large tiles on 132 SMs (half the machine idle) vs 128 square tiles
    assert get(512, 4096, 4096, 132) == "square"
    assert get(512, 4096, 14336, 132) == "square"  # K does not enter
    # N 6144: M 512 is 96 large tiles (73% of a wave) vs 128 large192 tiles (97%)
    assert get(512, 6144, 4096, 132) == "large192"
    assert get(1024, 6144, 4096, 132) == "large192"  # 256 large192 vs 192 large: two waves each
    # M 1024 over N 4096: 128 large tiles, one wave: large; clusters from CUDA_CLUSTER_M rows
    assert get(1024, 4096, 4096, 132) == "large"
    cm = gemm_config.CUDA_CLUSTER_M
    assert get(cm - 1, 4096, 4096, 132) == "large" and get(cm, 4096, 4096, 132) == "large_c2"
    assert get(8192, 4096, 4096, 132, cluster_m=1 << 30) == "large"
    # the SM count is the device's: on twice the SMs, 256 square tiles are one wave too
    assert get(1024, 4096, 4096, 264) == "square"
    # the efficiencies decide the close cases; 1.0: smaller tiles at no cost
    assert get(1024, 4096, 4096, 132, {"square": 1.0}) == "large"  # 1 wave vs 2 x half
    assert get(512, 6144, 4096, 132, {"large192": 0.7}) == "large"
    assert get(512, 6144, 4096, 132, {"large192": 0.7, "square": 1.2}) == "square"
    cost = gemm_config.cuda_wave_cost
    assert cost("large", 512, 4096, 132) == cost("large", 1024, 4096, 132) == 1.0
    assert cost("square", 512, 4096, 132, {"square": 0.5}) == 1.0
    with pytest.raises(ValueError, match="no efficiency for 'small'"):
        cost("small", 512, 4096, 132)


def test_build_script_present():
    script = ROOT / "scripts" / "build_csrc.sh"
    assert script.is_file() and os.access(script, os.X_OK)
    text = script.read_text()
    assert "CUTLASS_DIR" in text and "sm_90a" in text and gemm_cuda.LIB_NAME in text
    for name in ("api.cu", "gemm_bf16.cu", "gemm_fp16.cu", "gemm_bf16_slices.cu",
                 "gemm_fp16_slices.cu", "det_gemm_sm90.h", "det_gemm_internal.h"):  # fmt: skip
        assert (ROOT / "csrc" / "det_gemm" / name).is_file(), name
        if name.endswith(".cu"):
            assert f"csrc/det_gemm/{name}" in text, f"{name} is not built"
    assert (ROOT / "scripts" / "gpu_csrc.sh").is_file()


def test_build_script_needs_cutlass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUTLASS_DIR"}
    env["OUT_DIR"] = str(tmp_path)
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_csrc.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "CUTLASS_DIR" in res.stderr or "nvcc not found" in res.stderr, res.stderr
    assert not (tmp_path / gemm_cuda.LIB_NAME).exists()


@pytest.fixture
def captured_launches(monkeypatch):
    """The 16-bit launches det_gemm[cuda] would make, with CPU tensors (nothing runs): the
    layout decisions (product, leading dimensions, padded extents) checked without a GPU."""
    calls = []

    def fake_run16(product, cfg, a_ptr, lda, b_ptr, ldb, bias, d, ldd, m, n, k, like):
        calls.append(dict(kind="gemm", product=product, cfg=cfg, lda=lda, ldb=ldb, ldd=ldd, m=m,
                          n=n, k=k, a16=a_ptr % 16 == 0, b16=b_ptr % 16 == 0, bias=bias))  # fmt: skip

    def fake_slices(product, cfg, a_ptr, lda, stride_a, b_ptr, ldb, stride_b, partials, m, n, k,
                    like):  # fmt: skip
        calls.append(dict(kind="slices", product=product, cfg=cfg, a_ptr=a_ptr, lda=lda,
                          stride_a=stride_a, b_ptr=b_ptr, ldb=ldb, stride_b=stride_b, m=m, n=n,
                          k=k, p_ptr=partials.data_ptr(), p_shape=tuple(partials.shape),
                          p_stride=partials.stride(), p_dtype=partials.dtype))  # fmt: skip

    def fake_reduce(partials, bias, out, like):
        calls.append(dict(kind="reduce", p_ptr=partials.data_ptr(), p_shape=tuple(partials.shape),
                          p_stride=partials.stride(), bias=bias, out_ptr=out.data_ptr(),
                          out_shape=tuple(out.shape), ldd=out.stride(0), dtype=like.dtype))  # fmt: skip

    monkeypatch.setattr(gemm_cuda, "_run16", fake_run16)
    monkeypatch.setattr(gemm_cuda, "_run_slices", fake_slices)
    monkeypatch.setattr(gemm_cuda, "_run_reduce", fake_reduce)
    monkeypatch.setattr(gemm_cuda, "_check_cuda", lambda *t: None)
    monkeypatch.setattr(gemm_cuda, "_device_guard", lambda t: gemm_cuda._NO_GUARD)
    monkeypatch.setattr(gemm_cuda, "_sm_count", lambda t: gemm_config.DEFAULT_SM_COUNT)
    return calls


def test_launch_layouts(captured_launches):
    bf = torch.bfloat16
    a = torch.randn(5, 64).to(bf)
    w = torch.randn(24, 64).to(bf)
    out = gemm_cuda.det_gemm(a, w.t())  # nn.Linear: K-contiguous b, no copy
    (c,) = captured_launches
    assert out.shape == (5, 24)
    assert (c["product"], c["lda"], c["ldb"], c["m"], c["n"], c["k"]) == (0, 64, 64, 5, 24, 64)
    gemm_cuda.det_gemm(torch.randn(5, 24).to(bf), w)  # dgrad: N-contiguous b
    assert (captured_launches[-1]["product"], captured_launches[-1]["ldb"]) == (1, 64)
    # K and N not multiples of 8: zero-padded to 24 / 32, run as [5, 24] x [24, 32]
    gemm_cuda.det_gemm(
        torch.randn(5, 17).to(bf), torch.randn(17, 30).to(bf), torch.zeros(30, dtype=bf)
    )
    c = captured_launches[-1]
    assert (c["product"], c["k"], c["n"], c["lda"], c["ldb"], c["ldd"]) == (0, 24, 32, 24, 24, 32)
    # an expanded (stride 0) or misaligned operand is copied
    gemm_cuda.det_gemm(a[:1].expand(4, 64), w.t())
    assert captured_launches[-1]["lda"] == 64
    flat = torch.randn(5 * 64 + 3).to(bf)
    gemm_cuda.det_gemm(flat[3:].view(5, 64), w.t())
    assert captured_launches[-1]["a16"]
    for m in (1, 64, 65, 300):
        gemm_cuda.det_gemm(torch.randn(m, 64).to(bf), w.t())
        name = gemm_config.get_cuda_config(m, 24, 64)
        assert captured_launches[-1]["cfg"] == name


def test_wgrad_launch_layouts(captured_launches):
    bf = torch.bfloat16
    x = torch.randn(100, 20).to(bf)  # K = 20: padded to 24
    g = torch.randn(100, 32).to(bf)
    out = gemm_cuda.det_gemm_wgrad(x, g)
    c = captured_launches[-1]
    assert out.shape == (20, 32) and out.dtype == torch.float32
    assert (c["product"], c["m"], c["n"], c["k"], c["lda"], c["ldb"]) == (2, 24, 32, 100, 24, 32)


# --------------------------------------------------------------------------- CPU: split-K


def test_split_table_is_off():
    """Landed switched off: S = 1 for every product, so the family's bits and version are
    today's (a table entry > 1 is a new family version)."""
    assert gemm_config.CUDA_SPLIT_K == {}
    for n in (8, 24, 512, 1024, 4096, 6144, 14336, 28672, 151936):
        for k in (8, 64, 1000, 4096, 14336, 28672):
            assert gemm_config.get_cuda_split_k(n, k) == 1, (n, k)
    assert gemm_cuda.PROVIDER.numerics == "det_gemm/cuda-sm90"
    assert gemm_cuda.PROVIDER.version == "1"
    # the config choice with splits=1 is the unsplit one
    get = gemm_config.get_cuda_config
    for m in (1, 16, 64, 65, 256, 512, 1024, 8192):
        for n in (4096, 6144, 28672, 151936):
            assert get(m, n, 4096, 132, splits=1) == get(m, n, 4096, 132), (m, n)


def test_split_default_takes_the_plain_path(captured_launches):
    bf = torch.bfloat16
    w = torch.randn(48, 1024).to(bf)
    for m in (1, 5, 300):
        gemm_cuda.det_gemm(torch.randn(m, 1024).to(bf), w.t(), torch.randn(48).to(bf))
        gemm_cuda.det_gemm(torch.randn(m, 48).to(bf), w)  # the input-gradient product
    assert [c["kind"] for c in captured_launches] == ["gemm"] * 6
    gemm_cuda.det_gemm_with_config(torch.randn(5, 1024).to(bf), w.t(), None, None, split_k=1)
    assert captured_launches[-1]["kind"] == "gemm" and len(captured_launches) == 7


def test_split_slices():
    sl = gemm_config.cuda_split_k_slices
    assert sl(14336, 4) == [(0, 3584), (3584, 7168), (7168, 10752), (10752, 14336)]
    assert sl(4096, 8) == [(i * 512, (i + 1) * 512) for i in range(8)]
    assert sl(4608, 3) == [(0, 1536), (1536, 3072), (3072, 4608)]
    assert sl(1000, 1) == [(0, 1000)]  # S = 1: the unsplit product, any K
    for k, s in ((14336, 2), (14336, 8), (4096, 2), (192, 3), (128, 2)):
        slices = sl(k, s)
        assert slices[0][0] == 0 and slices[-1][1] == k and len(slices) == s
        assert all(a % 64 == 0 and b - a == k // s for a, b in slices)
        assert all(slices[i][1] == slices[i + 1][0] for i in range(s - 1))


def test_split_launch_arguments(captured_launches):
    """S > 1: one batched launch of the K slices (slice s of A at s * K/S elements, of B at
    s * K/S elements (K-contiguous) or rows (N-contiguous)), fp32 partials [S, M, N], then one
    reduction of those partials with the bias into the output."""
    bf = torch.bfloat16
    a = torch.randn(5, 1024).to(bf)
    w = torch.randn(24, 1024).to(bf)
    bias = torch.randn(24).to(bf)
    out = gemm_cuda.det_gemm_with_config(a, w.t(), bias, None, split_k=4)
    assert out.shape == (5, 24) and out.dtype == bf
    sl, red = captured_launches
    assert sl["kind"] == "slices" and red["kind"] == "reduce"
    assert (sl["product"], sl["m"], sl["n"], sl["k"]) == (0, 5, 24, 256)
    assert (sl["lda"], sl["stride_a"], sl["ldb"], sl["stride_b"]) == (1024, 256, 1024, 256)
    assert sl["a_ptr"] == a.data_ptr() and sl["b_ptr"] == w.data_ptr()  # no copies
    assert sl["p_shape"] == (4, 5, 24) and sl["p_stride"] == (120, 24, 1)
    assert sl["p_dtype"] == torch.float32
    assert sl["cfg"] == gemm_config.get_cuda_config(5, 24, 1024, 132, splits=4)
    assert red["p_ptr"] == sl["p_ptr"] and red["p_shape"] == (4, 5, 24)
    assert red["bias"] == bias.data_ptr() and red["out_shape"] == (5, 24) and red["ldd"] == 24
    assert red["dtype"] == bf
    # the input-gradient product (b N-contiguous, "NN"): slice s at s * K/S rows of B
    g = torch.randn(7, 1024).to(bf)
    w2 = torch.randn(1024, 48).to(bf)
    gemm_cuda.det_gemm_with_config(g, w2, None, "mid", split_k=8)
    sl, red = captured_launches[-2:]
    assert (sl["product"], sl["cfg"], sl["k"], sl["ldb"], sl["stride_b"]) == (1, "mid", 128, 48,
                                                                             128 * 48)  # fmt: skip
    assert (sl["stride_a"], sl["p_shape"]) == (128, (8, 7, 48)) and red["bias"] is None
    # N not a multiple of 8: padded to 32 (NT copies, as the unsplit product), cut after
    out = gemm_cuda.det_gemm_with_config(
        torch.randn(3, 384).to(bf), torch.randn(384, 30).to(bf), torch.zeros(30, dtype=bf),
        None, split_k=3,
    )  # fmt: skip
    sl, red = captured_launches[-2:]
    assert out.shape == (3, 30)
    assert (sl["product"], sl["n"], sl["k"], sl["ldb"], sl["stride_b"]) == (0, 32, 128, 384, 128)
    assert sl["p_shape"] == (3, 3, 32) and red["out_shape"] == (3, 32)


def test_split_follows_the_table(monkeypatch, captured_launches):
    """With a table entry, det_gemm (forward and the input-gradient product through the same
    function) splits without being asked; the entry is per (N, K), whatever M."""
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K", {(48, 1024): 2})
    bf = torch.bfloat16
    w = torch.randn(48, 1024).to(bf)
    for m in (1, 64, 1000):
        gemm_cuda.det_gemm(torch.randn(m, 1024).to(bf), w.t())
        sl, red = captured_launches[-2:]
        assert (sl["kind"], sl["m"], sl["k"], sl["p_shape"]) == ("slices", m, 512, (2, m, 48))
        assert red["kind"] == "reduce"
    gemm_cuda.det_gemm(torch.randn(5, 48).to(bf), w)  # (N, K) = (1024, 48): no entry
    assert captured_launches[-1]["kind"] == "gemm"


def test_split_rows_in_chunks(monkeypatch, captured_launches):
    """Partials over CUDA_SPLIT_K_MAX_WORKSPACE: the rows run in chunks (same bits: rows are
    independent), each a slice launch and a reduction into its rows of the output."""
    bf = torch.bfloat16
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K_MAX_WORKSPACE", 2 * 24 * 4 * 2)  # 2 rows
    a = torch.randn(5, 256).to(bf)
    out = gemm_cuda.det_gemm_with_config(a, torch.randn(24, 256).to(bf).t(), None, None,
                                         split_k=2)  # fmt: skip
    kinds = [c["kind"] for c in captured_launches]
    assert kinds == ["slices", "reduce"] * 3
    sls, reds = captured_launches[0::2], captured_launches[1::2]
    assert [c["m"] for c in sls] == [2, 2, 1]
    assert [c["a_ptr"] - a.data_ptr() for c in sls] == [0, 2 * 256 * 2, 4 * 256 * 2]
    assert [c["out_ptr"] - out.data_ptr() for c in reds] == [0, 2 * 24 * 2, 4 * 24 * 2]
    assert {c["p_ptr"] for c in sls} == {reds[0]["p_ptr"]}  # one buffer, reused in order
    assert [c["p_shape"] for c in reds] == [(2, 2, 24), (2, 2, 24), (2, 1, 24)]
    assert all(c["p_stride"][0] == 2 * 24 for c in reds)
    # many rows per chunk: a multiple of the 128-row tile
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K_MAX_WORKSPACE", 2 * 24 * 4 * 300)
    captured_launches.clear()
    gemm_cuda.det_gemm_with_config(torch.randn(1000, 256).to(bf),
                                   torch.randn(24, 256).to(bf).t(), None, None, split_k=2)  # fmt: skip
    assert [c["m"] for c in captured_launches if c["kind"] == "slices"] == [256] * 3 + [232]


def test_split_invalid_raises(monkeypatch, captured_launches):
    bf = torch.bfloat16
    a = torch.randn(4, 1024).to(bf)
    b = torch.randn(24, 1024).to(bf).t()
    run = gemm_cuda.det_gemm_with_config
    for s in (0, -1):
        with pytest.raises(ValueError, match="must be >= 1"):
            run(a, b, None, None, split_k=s)
    for s in (2.0, True, "2"):
        with pytest.raises(TypeError, match="must be an int"):
            run(a, b, None, None, split_k=s)
    with pytest.raises(ValueError, match="K=1000 does not cut into 2 slices.*multiple of 128"):
        run(torch.randn(4, 1000).to(bf), torch.randn(1000, 24).to(bf), None, None, split_k=2)
    with pytest.raises(ValueError, match="K=192 does not cut into 2 slices"):  # slices of 96
        run(torch.randn(4, 192).to(bf), torch.randn(192, 24).to(bf), None, None, split_k=2)
    with pytest.raises(ValueError, match="multiple of 64 columns"):
        run(a, b, None, None, split_k=32)  # slices of 32 columns
    with pytest.raises(ValueError, match="split-K is for bf16 / fp16"):
        run(a.float(), b.float(), None, None, split_k=2)
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K_MAX_WORKSPACE", 2 * 24 * 4 - 1)
    with pytest.raises(ValueError, match="workspace too large"):
        run(a, b, None, None, split_k=2)
    with pytest.raises(ValueError, match="needs S >= 2"):
        gemm_cuda.det_gemm_split_partials(a, b, 1)
    assert captured_launches == []  # nothing launched, no fallback to another S


@pytest.mark.skipif(gemm_cuda._load()[0] is None, reason="librl_engine_sm90.so not built")
def test_library_config_argument_checks():
    """The built library (no GPU needed: these fail before touching CUDA) refuses a config
    index it does not know, and the weight gradient at a config it is not built for."""
    import ctypes

    lib = gemm_cuda._lib()
    # K 128: a K every staging runs (the *_k128 ones refuse K % 128 != 0 before the dispatch)
    args = gemm_cuda._Args(4, 8, 128, None, 128, None, 128, None, None, 8, None, -1, None)
    nt, wgrad = 0, 2
    for product in (nt, wgrad):
        rc = lib.rle_det_gemm_sm90(0, product, 99, ctypes.byref(args))
        assert rc == -1 and "unknown config 99" in lib.rle_last_error().decode()
    rc = lib.rle_det_gemm_sm90_batched(0, nt, 99, 2, 64, 64, 64, ctypes.byref(args))
    assert rc == -1 and "unknown config 99" in lib.rle_last_error().decode()
    for name, idx in gemm_config.CUDA_CONFIGS.items():
        if name in ("large", "mid"):
            continue
        rc = lib.rle_det_gemm_sm90(0, wgrad, idx, ctypes.byref(args))
        err = lib.rle_last_error().decode()
        assert rc == -1 and f"config {idx} is not built for the weight gradient" in err, name


@pytest.mark.skipif(gemm_cuda._load()[0] is None, reason="librl_engine_sm90.so not built")
def test_library_split_k_argument_checks():
    """The built library (no GPU needed: every call fails its checks before touching CUDA)
    refuses split-K arguments it cannot run, with the reason."""
    import ctypes

    lib = gemm_cuda._lib()
    assert lib.rle_abi_version() == gemm_cuda._ABI_VERSION == 5
    args = gemm_cuda._Args(4, 8, 64, None, 64, None, 64, None, None, 8, None, -1, None)

    def batched(product, batch, sa, sb, sd):
        rc = lib.rle_det_gemm_sm90_batched(0, product, 2, batch, sa, sb, sd, ctypes.byref(args))
        return rc, lib.rle_last_error().decode()

    rc, msg = batched(0, 2, 30, 32, 64)  # A's batch stride not 16 bytes
    assert rc == -1 and "multiples of 8 elements" in msg
    rc, msg = batched(0, 2, 32, 32, 16)  # D batches overlap (m * ldd = 32)
    assert rc == -1 and ">= m * ldd = 32" in msg
    rc, msg = batched(2, 2, 32, 32, 32)  # the weight gradient is never split
    assert rc == -1 and "RLE_NT (0) or RLE_NN (1)" in msg
    rc, msg = batched(0, 0, 32, 32, 32)
    assert rc == -1 and "batch must be in [1, 2^31)" in msg
    args.bias = 16
    rc, msg = batched(0, 2, 32, 32, 32)
    assert rc == -1 and "takes no bias" in msg
    args.bias = None
    for cfg in (gemm_config.CUDA_CONFIGS["mid_k128"], gemm_config.CUDA_CONFIGS["small_k128"]):
        # the 128-column stagings refuse a K they would walk in other blocks (64 here)
        rc = lib.rle_det_gemm_sm90_batched(0, 0, cfg, 2, 64, 64, 64, ctypes.byref(args))
        assert rc == -1 and "must be a multiple of 128" in lib.rle_last_error().decode()
        rc = lib.rle_det_gemm_sm90(0, 0, cfg, ctypes.byref(args))
        assert rc == -1 and "must be a multiple of 128" in lib.rle_last_error().decode()
    rc = lib.rle_splitk_reduce(0, 4, 8, 2, None, 8, 8, None, None, 8, None)
    assert rc == -1 and "stride_p >= m * ldp" in lib.rle_last_error().decode()
    rc = lib.rle_splitk_reduce(2, 4, 8, 2, None, 8, 32, None, None, 8, None)
    assert rc == -1 and "bf16 (0) or fp16 (1)" in lib.rle_last_error().decode()


def test_k128_stagings(captured_launches):
    """The `*_k128` configurations stage 128 K columns: they launch where K (per split-K slice,
    after the padding to a multiple of 8) is a multiple of 128 and raise with the reason
    elsewhere, before any launch (no other config taken in their place)."""
    assert gemm_config.CUDA_STAGE_K == {
        c: 128 if c in ("mid_k128", "small_k128") else 64 for c in gemm_config.CUDA_CONFIGS
    }
    assert gemm_config.CUDA_TILES["mid_k128"] == gemm_config.CUDA_TILES["mid"]
    assert gemm_config.CUDA_TILES["small_k128"] == gemm_config.CUDA_TILES["small"]
    bf = torch.bfloat16
    w = torch.randn(16, 256).to(bf)
    gemm_cuda.det_gemm_with_config(torch.randn(3, 256).to(bf), w.t(), None, "mid_k128")
    assert [(c["cfg"], c["k"]) for c in captured_launches] == [("mid_k128", 256)]
    # K 250 pads to 256: the padded problem is what both stagings walk
    gemm_cuda.det_gemm_with_config(torch.randn(3, 250).to(bf), w[:, :250].t(), None, "small_k128")
    assert (captured_launches[-1]["cfg"], captured_launches[-1]["k"]) == ("small_k128", 256)
    captured_launches.clear()
    for k, split in ((192, None), (256, 4)):  # K 192; slices of 64
        a = torch.randn(3, k).to(bf)
        for cfg in ("mid_k128", "small_k128"):
            with pytest.raises(ValueError, match="stages 128 K columns"):
                gemm_cuda.det_gemm_with_config(a, w[:, :k].t(), None, cfg, split_k=split)
        gemm_cuda.det_gemm_with_config(a, w[:, :k].t(), None, "mid", split_k=split)
    assert [c["cfg"] for c in captured_launches if c["kind"] != "reduce"] == ["mid", "mid"]
    assert gemm_config.cuda_config_fits("large", 24) and not gemm_config.cuda_config_fits(
        "mid_k128", 4160
    )


def test_cuda_config_with_splits():
    """The tile choice counts the slices' tiles (launch shape only, no numerics): short prefill
    over N 4096 keeps `small` while small x S fills no more than a wave."""
    get = gemm_config.get_cuda_config
    assert [get(64, 4096, 4096, 132, splits=s) for s in (1, 2, 4)] == ["small", "small", "mid"]
    assert get(1, 4096, 4096, 132, splits=8) == "mid"
    cost = gemm_config.cuda_wave_cost
    assert cost("large", 512, 4096, 132, splits=2) == 1.0  # 128 tiles: one wave
    assert cost("large", 1024, 4096, 132, splits=2) == 2.0
    # the wave model above 256 rows sees S times the tiles
    assert get(512, 4096, 4096, 132, splits=2) == "large"


# --------------------------------------------------------------------------- GPU

_REASON = (
    gemm_cuda.PROVIDER.why_not("cuda", triton_interpret=False)
    if torch.cuda.is_available()
    else "needs a CUDA device"
)
gpu = pytest.mark.skipif(_REASON is not None, reason=f"det_gemm[cuda]: {_REASON}")

# M thresholds of the config choice (16, 64-row blocks, 256) straddled, odd counts, up to 8192
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 199, 255, 256, 257)
ROW_COUNTS += (511, 512, 513, 1000, 1024, 2047, 2048, 4096, 4097, 8191, 8192)
DTYPES16 = (torch.bfloat16, torch.float16)


def _randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def _gemm(a, b, bias=None):
    return det_gemm(a, b, bias, backend="cuda")


@gpu
@pytest.mark.parametrize("dtype", (*DTYPES16, torch.float32))
@pytest.mark.parametrize(
    "shape", [(1, 16, 8), (33, 100, 70), (17, 760, 129), (300, 1128, 520), (64, 4096, 4096)]
)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_numerics_vs_float64(dtype, shape, layout):
    m, k, n = shape
    a = _randn(m, k, dtype=dtype, seed=m + k)
    w = _randn(n, k, dtype=dtype, seed=n, scale=k**-0.5)
    b = w.t() if layout == "nt" else w.t().contiguous()
    bias = _randn(n, dtype=dtype, seed=3)
    for bb in (None, bias):
        out = _gemm(a, b, bb)
        assert out.dtype == dtype and out.shape == (m, n) and out.is_contiguous()
        ref = a.double() @ b.double() + (0 if bb is None else bb.double())
        rtol, atol = tolerance(dtype, k=k)
        assert_close(out, ref, rtol=rtol, atol=atol, what=f"det_gemm[cuda] {shape} {dtype}")


@gpu
def test_empty_and_strided():
    a = _randn(0, 64)
    b = _randn(64, 24)
    assert _gemm(a, b).shape == (0, 24)
    assert torch.equal(
        _gemm(_randn(5, 0), _randn(0, 3)), torch.zeros(5, 3, device="cuda").bfloat16()
    )
    big = _randn(40, 200)
    a = big[::2, 8:136]  # strided rows, offset columns
    b = _randn(128, 48)
    ref = a.double() @ b.double()
    rtol, atol = tolerance(torch.bfloat16, k=128)
    assert_close(_gemm(a, b), ref, rtol=rtol, atol=atol, what="strided a")
    assert_bitwise(_gemm(a, b), _gemm(a.contiguous(), b), "strided a == contiguous a")


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("kn", [(4096, 4096), (14336, 512), (760, 129)])
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_row_invariance_bitwise(dtype, kn, layout):
    """Each row alone == inside batches of M = 1..8192 (every config threshold), bitwise."""
    k, n = kn
    x = _randn(max(ROW_COUNTS), k, dtype=dtype, seed=11)
    w = _randn(n, k, dtype=dtype, seed=12, scale=k**-0.5)
    b = w.t() if layout == "nt" else w.t().contiguous()
    bias = _randn(n, dtype=dtype, seed=13)
    full = _gemm(x, b, bias)
    assert_bitwise(_gemm(x, b, bias), full, "run-to-run")
    for m in ROW_COUNTS:
        assert_bitwise(_gemm(x[:m], b, bias), full[:m], f"first {m} rows ({layout}, K={k}, N={n})")
    for i in (0, 1, 4095, max(ROW_COUNTS) - 1):
        assert_bitwise(_gemm(x[i : i + 1], b, bias), full[i : i + 1], f"row {i} alone")
    padded = torch.cat([x[:100], torch.zeros_like(x[:29])])
    assert_bitwise(_gemm(padded, b, bias)[:100], full[:100], "zero-padding rows")


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
def test_every_config_bitwise_equal(dtype):
    a = _randn(1000, 4096, dtype=dtype, seed=21)
    w = _randn(3000, 4096, dtype=dtype, seed=22, scale=4096**-0.5)
    bias = _randn(3000, dtype=dtype, seed=23)
    for b in (w.t(), w.t().contiguous()):
        outs = {c: gemm_cuda.det_gemm_with_config(a, b, bias, c) for c in gemm_config.CUDA_CONFIGS}
        first = next(iter(outs.values()))
        for c, out in outs.items():
            assert_bitwise(out, first, f"config {c}")


@gpu
@pytest.mark.parametrize("k", [4224, 4160])
def test_every_config_bitwise_equal_k_tail(k):
    """K 4224 (33 blocks of 128, 66 of 64): every config, 128-column stagings included, gives
    the same bits, decode and prefill rows; K 4160 (65 blocks of 64): the 64-column configs do,
    the 128-column ones refuse it (they would walk a zero-filled block more)."""
    a = _randn(300, k, seed=24)
    w = _randn(1000, k, seed=25, scale=k**-0.5)
    bias = _randn(1000, seed=26)
    for b in (w.t(), w.t().contiguous()):
        for rows in (1, 16, 300):
            outs = {}
            for c in gemm_config.CUDA_CONFIGS:
                if gemm_config.cuda_config_fits(c, k):
                    outs[c] = gemm_cuda.det_gemm_with_config(a[:rows], b, bias, c)
                else:
                    with pytest.raises(ValueError, match="stages 128 K columns"):
                        gemm_cuda.det_gemm_with_config(a[:rows], b, bias, c)
            assert ("mid_k128" in outs) == (k % 128 == 0)
            first = outs["large"]
            for c, out in outs.items():
                assert_bitwise(out, first, f"config {c}, {rows} rows, K={k}")


@gpu
def test_layouts_bitwise_equal():
    """b K-contiguous (w.t()) and N-contiguous give the same bits (one wgmma math either way)."""
    a = _randn(300, 4096, seed=31)
    w = _randn(1024, 4096, seed=32, scale=4096**-0.5)
    assert_bitwise(_gemm(a, w.t()), _gemm(a, w.t().contiguous()), "NT == NN")


@gpu
def test_column_invariance_and_cat():
    a = _randn(257, 4096, seed=41)
    w = _randn(1000, 4096, seed=42, scale=4096**-0.5)
    full = _gemm(a, w.t())
    for j0, j1 in ((0, 128), (5, 9), (96, 1000), (512, 777)):
        assert_bitwise(_gemm(a, w[j0:j1].t()), full[:, j0:j1], f"columns {j0}:{j1}")
    parts = [w[:300], w[300:701], w[701:]]
    assert_bitwise(det_gemm_cat(a, parts, backend="cuda"), full, "det_gemm_cat == det_gemm")


@gpu
def test_wgrad_fp32_refused():
    # the fp32 CUDA-core wgrad sums all tokens into one accumulator: above the fp32 gradient
    # tolerance at T = 5000 (H200, 2026-11-27), so it is refused with the reason
    x = _randn(64, 32, dtype=torch.float32, seed=50)
    with pytest.raises(TypeError, match="float32 inputs are not supported"):
        gemm_cuda.det_gemm_wgrad(x, x)


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
def test_wgrad(dtype):
    t, ko, n = 5000, 760, 1032
    x = _randn(t, ko, dtype=dtype, seed=51)
    g = _randn(t, n, dtype=dtype, seed=52)
    dw = gemm_cuda.det_gemm_wgrad(x, g)
    assert dw.dtype == torch.float32 and dw.shape == (ko, n)
    rtol, atol = tolerance(dtype, grad=True, k=t)
    assert_close(dw, x.double().t() @ g.double(), rtol=rtol, atol=atol, what=f"wgrad {dtype}")
    assert_bitwise(gemm_cuda.det_gemm_wgrad(x, g), dw, "wgrad run-to-run")
    zx, zg = torch.zeros_like(x[:77]), torch.zeros_like(g[:77])
    padded = gemm_cuda.det_gemm_wgrad(torch.cat([x, zx]), torch.cat([g, zg]))
    assert_bitwise(padded, dw, "wgrad with zero-padding rows")


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
def test_backward(dtype):
    w = _randn(520, 1128, dtype=dtype, seed=61, scale=1128**-0.5)
    bias = _randn(520, dtype=dtype, seed=62)
    x = _randn(1500, 1128, dtype=dtype, seed=63)
    g = _randn(1500, 520, dtype=dtype, seed=64)

    def grads(rows):
        xi = x[:rows].clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        bi = bias.clone().requires_grad_(True)
        _gemm(xi, wi.t(), bi).backward(g[:rows])
        return xi.grad, wi.grad, bi.grad

    dx, dw, db = grads(1500)
    dx2, dw2, db2 = grads(1500)
    for u, v, what in ((dx, dx2, "dx"), (dw, dw2, "dw"), (db, db2, "dbias")):
        assert_bitwise(u, v, f"{what} run-to-run")
    for rows in (1, 17, 300, 1499):
        assert_bitwise(grads(rows)[0], dx[:rows], f"dx first {rows} rows")
    rtol, atol = tolerance(dtype, grad=True, k=1500)
    ref_dw = (g.double().t() @ x.double()).to(dtype)
    assert_close(dw, ref_dw, rtol=rtol, atol=atol, what="dw vs float64")
    assert_close(dx, g.double() @ w.double(), rtol=rtol, atol=atol, what="dx vs float64")


@gpu
def test_cuda_graph_capture_replay():
    w = _randn(4096, 4096, seed=71, scale=4096**-0.5)
    bias = _randn(4096, seed=72)
    for m in (1, 64, 300, 2048):
        a = _randn(m, 4096, seed=73 + m)
        eager = _gemm(a, w.t(), bias)
        static_a = a.clone()
        _gemm(static_a, w.t(), bias)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _gemm(static_a, w.t(), bias)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(static_out, eager, f"graph replay M={m}")
        a2 = _randn(m, 4096, seed=99 + m)
        static_a.copy_(a2)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(static_out, _gemm(a2, w.t(), bias), f"graph replay, new inputs M={m}")


@gpu
def test_linear_logp_native_equals_unfused(monkeypatch):
    """With det_gemm pinned to cuda, linear_logp's native provider == logp(det_gemm(...))."""
    from rl_engine.ops import linear_logp, logp

    monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", "cuda")
    config.reload()
    h = _randn(37, 1024, seed=81)
    w = _randn(5000, 1024, seed=82, scale=1024**-0.5)
    tok = torch.randint(0, 5000, (37,), device="cuda")
    fused = linear_logp(h, w, tok, 0.7, backend="native")
    unfused = logp(det_gemm(h, w.t()), tok, 0.7, backend="native")
    assert_bitwise(fused, unfused, "linear_logp[native] == logp(det_gemm[cuda])")
    # the Triton provider's logits are Triton det_gemm bits: it refuses and names the providers
    # that take the resolved det_gemm's logits
    with pytest.raises(BackendUnavailableError, match="unfused provider .* or the native one"):
        linear_logp(h, w, tok, 0.7, backend="triton")


@gpu
def test_tp_shards_equal_tp1():
    from rl_engine.ops.det_gemm import tp

    a = _randn(19, 1024, seed=91)
    b = _randn(1024, 264, seed=92)
    full = tp.det_gemm_tp(a, b, backend="cuda")
    for deg in (2, 4, 8):
        k = 1024 // deg
        subs = [
            tp.subtree(a[:, r * k : (r + 1) * k], b[r * k : (r + 1) * k], 8 // deg, backend="cuda")
            for r in range(deg)
        ]
        assert_bitwise(tp.finish(tp.combine(subs), None, a.dtype), full, f"TP {deg} shards")


# --------------------------------------------------------------------------- GPU: split-K
# Forced S (the table is off): K = 4608 = 64 * 72 cuts into slices of whole 64-blocks for every S
SPLITS = (2, 3, 4, 8)
SPLIT_ROWS = tuple(m for m in ROW_COUNTS if m <= 1024)


def _split(a, b, bias, s, cfg=None):
    return gemm_cuda.det_gemm_with_config(a, b, bias, cfg, split_k=s)


@gpu
@pytest.mark.parametrize("s", SPLITS)
@pytest.mark.parametrize("n", [512, 760])
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_split_k_row_invariance_bitwise(s, n, layout):
    """Each row alone == inside batches of M = 1..1024, bitwise, for a fixed S (a function of
    N and K only)."""
    k = 4608
    x = _randn(1024, k, seed=111)
    w = _randn(n, k, seed=112, scale=k**-0.5)
    b = w.t() if layout == "nt" else w.t().contiguous()
    bias = _randn(n, seed=113)
    full = _split(x, b, bias, s)
    assert_bitwise(_split(x, b, bias, s), full, f"S={s} run-to-run")
    for m in SPLIT_ROWS:
        assert_bitwise(_split(x[:m], b, bias, s), full[:m], f"S={s} first {m} rows ({layout})")
    for i in (0, 1, 513, 1023):
        assert_bitwise(_split(x[i : i + 1], b, bias, s), full[i : i + 1], f"S={s} row {i} alone")
    padded = torch.cat([x[:100], torch.zeros_like(x[:29])])
    assert_bitwise(_split(padded, b, bias, s)[:100], full[:100], f"S={s} zero-padding rows")


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("s", SPLITS)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_split_k_vs_sliced_reference(dtype, s, layout):
    """Partial s == the product of K slice s (a torch reference per slice) within fp32
    rounding; the output == the partials added in slice order in fp32, + bias, rounded once,
    bitwise (the reduction's order); and == the torch reference of the same slice order within
    one rounding."""
    m, k, n = 77, 4608, 520
    a = _randn(m, k, dtype=dtype, seed=121)
    w = _randn(n, k, dtype=dtype, seed=122, scale=k**-0.5)
    b = w.t() if layout == "nt" else w.t().contiguous()
    bias = _randn(n, dtype=dtype, seed=123)
    parts = gemm_cuda.det_gemm_split_partials(a, b, s)
    assert parts.dtype == torch.float32 and parts.shape == (s, m, n)
    slices = gemm_config.cuda_split_k_slices(k, s)
    ks = k // s
    rtol, atol = tolerance(torch.float32, k=ks)
    ref_sum = None
    for i, (k0, k1) in enumerate(slices):
        ref = (a[:, k0:k1].double() @ b[k0:k1].double()).float()  # slice i's fp32 value
        assert_close(parts[i], ref, rtol=rtol, atol=atol, what=f"S={s} partial {i}")
        ref_sum = ref if ref_sum is None else ref_sum + ref
    ordered = parts[0].clone()
    for i in range(1, s):
        ordered = ordered + parts[i]
    out = _split(a, b, bias, s)
    assert_bitwise(out, (ordered + bias.float()).to(dtype), f"S={s} reduction in slice order")
    assert_bitwise(_split(a, b, None, s), ordered.to(dtype), f"S={s} reduction, no bias")
    rtol, atol = tolerance(dtype, k=k)
    ref_out = ref_sum + bias.float()
    assert_close(out, ref_out, rtol=rtol, atol=atol, what=f"S={s} vs sliced torch reference")


@gpu
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("mkn", [(1, 4096, 4096), (64, 14336, 1024), (300, 4096, 6144)])
def test_split_k_vs_cublas(dtype, mkn):
    """S > 1 is within the 16-bit rounding of cuBLAS (and of float64)."""
    m, k, n = mkn
    a = _randn(m, k, dtype=dtype, seed=131)
    w = _randn(n, k, dtype=dtype, seed=132, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=133)
    rtol, atol = tolerance(dtype, k=k)
    cublas = torch.addmm(bias, a, w.t())
    for s in (2, 4, 8):
        out = _split(a, w.t(), bias, s)
        assert_close(out, cublas, rtol=rtol, atol=atol, what=f"S={s} {mkn} vs cuBLAS")
        ref = a.double() @ w.double().t() + bias.double()
        assert_close(out, ref, rtol=rtol, atol=atol, what=f"S={s} {mkn} vs float64")


@gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_split_k_every_config_bitwise_equal(layout):
    a = _randn(300, 4608, seed=141)
    w = _randn(1000, 4608, seed=142, scale=4608**-0.5)
    b = w.t() if layout == "nt" else w.t().contiguous()
    bias = _randn(1000, seed=143)
    for s in (2, 3):
        outs = {c: _split(a, b, bias, s, c) for c in gemm_config.CUDA_CONFIGS}
        first = next(iter(outs.values()))
        for c, out in outs.items():
            assert_bitwise(out, first, f"S={s} config {c}")


@gpu
def test_split_k_row_chunks_bitwise(monkeypatch):
    """Partials over the workspace cap run in row chunks: the same bits."""
    a = _randn(700, 4096, seed=151)
    w = _randn(1024, 4096, seed=152, scale=4096**-0.5)
    bias = _randn(1024, seed=153)
    whole = _split(a, w.t(), bias, 4)
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K_MAX_WORKSPACE", 4 * 1024 * 4 * 200)
    assert_bitwise(_split(a, w.t(), bias, 4), whole, "row chunks of 128")


@gpu
def test_split_k_cuda_graph():
    w = _randn(4096, 4096, seed=161, scale=4096**-0.5)
    bias = _randn(4096, seed=162)
    for m in (1, 300):
        a = _randn(m, 4096, seed=163 + m)
        eager = _split(a, w.t(), bias, 4)
        static_a = a.clone()
        _split(static_a, w.t(), bias, 4)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _split(static_a, w.t(), bias, 4)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(static_out, eager, f"S=4 graph replay M={m}")


@gpu
def test_split_k_from_the_table_forward_and_input_gradient(monkeypatch):
    """Table entries (forced here) split the forward (NT) and the input-gradient product (NN,
    through autograd), each by its own (N, K); the weight gradient is not split; rows stay batch
    invariant."""
    n, k = 640, 1152  # forward (N, K) = (640, 1152); input gradient (N, K) = (1152, 640)
    w = _randn(n, k, seed=171, scale=k**-0.5)
    x = _randn(900, k, seed=172)
    gy = _randn(900, n, seed=173)

    def grads(rows):
        xi = x[:rows].clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        y = _gemm(xi, wi.t())
        y.backward(gy[:rows])
        return y.detach(), xi.grad, wi.grad

    _, _, dw_plain = grads(900)
    monkeypatch.setattr(gemm_config, "CUDA_SPLIT_K", {(n, k): 3, (k, n): 2})
    y, dx, dw = grads(900)
    assert_bitwise(y, _split(x, w.t(), None, 3), "forward: the table's S = 3")
    assert_bitwise(dx, _split(gy, w, None, 2), "input gradient (NN): the table's S = 2")
    assert_bitwise(dw, dw_plain, "weight gradient: not split")
    for rows in (1, 17, 300):
        yr, dxr, _ = grads(rows)
        assert_bitwise(yr, y[:rows], f"forward first {rows} rows")
        assert_bitwise(dxr, dx[:rows], f"input gradient first {rows} rows")


@gpu
def test_errors():
    a = _randn(4, 16)
    with pytest.raises(TypeError):
        _gemm(a, _randn(16, 8, dtype=torch.float16))
    with pytest.raises(ValueError):
        _gemm(a, _randn(15, 8))
    with pytest.raises(RuntimeError, match="CUDA only"):
        gemm_cuda.det_gemm(a.cpu(), _randn(16, 8).cpu())
    with pytest.raises(ValueError, match="config"):
        gemm_cuda.det_gemm_with_config(a, _randn(16, 8), None, "huge")
    with pytest.raises(ValueError, match="same number of rows"):
        gemm_cuda.det_gemm_wgrad(a, _randn(5, 8))
