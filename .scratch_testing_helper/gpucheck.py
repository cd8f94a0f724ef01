import sys, time, torch
sys.path.insert(0, "python")
from megamoe.testing import make_layer, baseline, compare, assert_close_to_oracle
print(torch.__version__, torch.cuda.get_device_name())
calls = {"n": 0}
orig = torch._grouped_mm
def counting(*a, **k):
    calls["n"] += 1
    return orig(*a, **k)
torch._grouped_mm = counting

def grads(lay, **kw):
    lay.reprepare_base()
    leaves = lay.grad_leaves()
    for t in leaves.values():
        t.grad = None
    out = lay.call(baseline.moe, **kw)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    return out.detach(), {k: v.grad.clone() for k, v in leaves.items()}

for act, clamp in (("swiglu", None), ("geglu", None), ("swiglu", 0.75)):
    kw = dict(num_tokens=301, seed=3, device="cuda", routing="masked", empty_experts=(0, 4),
              requires_grad=True, trainable_base=True, activation=act, activation_clamp=clamp)
    lay = make_layer(512, 256, 8, 3, 32, **kw)
    calls["n"] = 0
    o_g, g_g = grads(lay)
    n = calls["n"]
    o_l, g_l = grads(lay, use_grouped_mm=False)
    lay64 = make_layer(512, 256, 8, 3, 32, dtype=torch.float64, **kw)
    o_r, g_r = grads(lay64)
    print(act, "grouped_mm calls", n)
    assert n == 5, n
    print(" out gmm-vs-loop", compare(o_g, o_l), "| vs f64", compare(o_g, o_r))
    (clamp is not None) or assert_close_to_oracle("out", o_g, o_r, min_cosine=0.9999)
    for k in g_r:
        print(" grad", k, "gmm-vs-loop", compare(g_g[k], g_l[k]), "| vs f64", compare(g_g[k], g_r[k]))
        (clamp is not None) or assert_close_to_oracle(k, g_g[k], g_r[k], min_cosine=0.9999)
    assert (g_g["w13"][[0, 4]] == 0).all() and (g_g["b1"][[0, 4]] == 0).all()
    assert (g_g["topk_weights"][lay.topk_ids < 0] == 0).all()
print("small checks OK", flush=True)

def timeit(fn, n=10):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ev)[n // 2]

t0 = time.time()
lay = make_layer(4096, 2048, 64, 6, 128, num_tokens=65536, device="cuda", requires_grad=True)
print("make_layer ep4rank s", round(time.time() - t0, 1), flush=True)
dout = torch.randn_like(lay.x)
pair = (lay.w13, lay.w2)
def fwd(b):
    with torch.no_grad():
        baseline.moe(lay.x, lay.topk_ids, lay.topk_weights, b, lay.side)
def fb(b):
    baseline.moe(lay.x, lay.topk_ids, lay.topk_weights, b, lay.side).backward(dout)
for name, b in (("pair", pair), ("BaseWeights", lay.base)):
    torch.cuda.reset_peak_memory_stats()
    f = timeit(lambda: fwd(b)); t = timeit(lambda: fb(b))
    print(name, "fwd ms", round(f, 2), "F+B ms", round(t, 2), "peak GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1), flush=True)
w13p = lay.w13.detach().requires_grad_(True); w2p = lay.w2.detach().requires_grad_(True)
def fb_ord():
    baseline.moe(lay.x, lay.topk_ids, lay.topk_weights, (w13p, w2p)).backward(dout)
torch.cuda.reset_peak_memory_stats()
t = timeit(fb_ord)
print("ordinary pair F+B ms", round(t, 2), "peak GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1))
