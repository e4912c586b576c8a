import cProfile, pstats, sys, time, torch
sys.path.insert(0, '.')
from rl_engine.ops.det_gemm import triton as G
dt = torch.bfloat16
wt = torch.randn(4096, 4096, device="cuda", dtype=dt).t()
for m in (512, 1):
    a = torch.randn(m, 4096, device="cuda", dtype=dt)
    for _ in range(50): G.det_gemm(a, wt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500): G.det_gemm(a, wt)
    torch.cuda.synchronize()
    print(f"M={m}: {1e6*(time.perf_counter()-t0)/500:.1f} us/call", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500): G.det_gemm(a, wt)
    pr.disable(); torch.cuda.synchronize()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(22)
