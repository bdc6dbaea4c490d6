#!/usr/bin/env python3
"""Checks the CUDA kernels' outputs (dumped by `bench_cuda --dump DIR`) against PyTorch.

Tolerances: rms_norm, rope, silu 1e-5 relative (max(1, |ref|)); bf16 GEMV 1e-4 of the row's
sum |w x| (f32 accumulation, another order); attention over the f16 paged pool 2e-3 absolute
(inputs in [-1, 1]; reference in f32 with Q rounded to f16 like the kernel); greedy sampling
exact (torch.argmax).

usage: torch_kernel_check.py DIR OUT.json   (exit 1 when a check fails)
"""
import json
import math
import sys

import numpy as np
import torch


def load(d, meta, name):
    m = meta[name]
    dt = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "bf16": np.int16}[m["dtype"]]
    a = np.fromfile(f"{d}/{name}.bin", dtype=dt).reshape(m["shape"])
    t = torch.from_numpy(a.copy())
    if m["dtype"] == "bf16":
        t = t.view(torch.bfloat16)  # same 16 bits, reinterpreted
    return t.cuda()


def rel_err(got, ref):
    return ((got.double() - ref.double()).abs() / ref.double().abs().clamp(min=1.0)).max().item()


def main():
    d, out_path = sys.argv[1], sys.argv[2]
    meta = json.load(open(f"{d}/meta.json"))
    L = lambda n: load(d, meta, n)
    results = {}

    def record(name, err, tol):
        ok = err <= tol
        results[name] = {"max_error": err, "tolerance": tol, "ok": ok}
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.3g} (tolerance {tol:g})", flush=True)

    # RMSNorm
    x, w = L("rms_x"), L("rms_w")
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    record("rms_norm", rel_err(L("rms_out"), ref), 1e-5)

    # RoPE: pair-adjacent (GGUF Llama) and NeoX halves, base 500000, rotary = head_dim.
    # The kernel builds theta_i = pos * s^i by float32 recurrence like ggml (and the CPU
    # backend); the reference does the same recurrence in float32 and rotates in float64
    # (tolerance 1e-5). Against exact angles the recurrence drifts by a few ulps of theta at
    # large positions, reported with a looser 5e-3.
    x, pos = L("rope_x").double(), L("rope_pos")
    hd = x.shape[-1]
    s32 = np.float32(L("rope_theta_scale").cpu().numpy()[0])
    theta = pos.float().clone()
    cols = []
    for _ in range(hd // 2):
        cols.append(theta.clone())
        theta = theta * torch.tensor(s32, device="cuda")
    ang_rec = torch.stack(cols, dim=-1).double()  # [rows, hd/2]
    inv = 500000.0 ** (-torch.arange(0, hd, 2, device="cuda", dtype=torch.float64) / hd)
    ang_exact = pos.double()[:, None] * inv[None, :]

    def rotate(ang):
        c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        pairs = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
        h0, h1 = x[..., : hd // 2], x[..., hd // 2:]
        neox = torch.cat([h0 * c - h1 * s, h0 * s + h1 * c], dim=-1)
        return pairs, neox

    pairs, neox = rotate(ang_rec)
    record("rope_pairs", (L("rope_pairs_out").double() - pairs).abs().max().item(), 1e-5)
    record("rope_neox", (L("rope_neox_out").double() - neox).abs().max().item(), 1e-5)
    pairs, neox = rotate(ang_exact)
    record("rope_pairs_vs_exact_angles", (L("rope_pairs_out").double() - pairs).abs().max().item(), 5e-3)
    record("rope_neox_vs_exact_angles", (L("rope_neox_out").double() - neox).abs().max().item(), 5e-3)

    # SiLU * up
    g, u = L("silu_gate").double(), L("silu_up").double()
    record("silu_mul", rel_err(L("silu_out"), torch.nn.functional.silu(g) * u), 1e-5)

    # bf16 GEMV
    wt = L("gemv_w_bf16").double()
    for nt in (1, 3, 8):
        xx = L(f"gemv_x{nt}").double()
        ref = xx @ wt.T
        scale = (xx.abs() @ wt.abs().T).clamp(min=1.0)
        err = ((L(f"gemv_y{nt}").double() - ref).abs() / scale).max().item()
        record(f"gemv_bf16_{nt}tok", err, 1e-4)

    # Attention over the paged pool (GQA 32/8, head_dim 128, block 16, f16 cache)
    q = L("attn_q").float()
    kp, vp = L("attn_k_pool").float(), L("attn_v_pool").float()
    ids, seqs = L("attn_block_ids").long(), L("attn_seqs").tolist()
    heads, kvh = q.shape[1], kp.shape[2]
    group = heads // kvh
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh = q.half().float()
    out_p, out_d = L("attn_prefill_out"), L("attn_decode_out")
    row, err_p, err_d = 0, 0.0, 0.0
    for nq, ctx, first in seqs:
        nb = (ctx + kp.shape[1] - 1) // kp.shape[1]
        blocks = ids[first:first + nb]
        k = kp[blocks].reshape(-1, kvh, kp.shape[-1])[:ctx]  # [ctx, kvh, hd]
        v = vp[blocks].reshape(-1, kvh, vp.shape[-1])[:ctx]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, hd]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qq = qh[row:row + nq].transpose(0, 1)  # [heads, nq, hd]
        qpos = torch.arange(ctx - nq, ctx, device="cuda")[:, None]
        mask = torch.arange(ctx, device="cuda")[None, :] <= qpos  # [nq, ctx]
        ref = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale)
        ref = ref.transpose(0, 1)  # [nq, heads, hd]
        err_p = max(err_p, (out_p[row:row + nq] - ref).abs().max().item())
        if nq == 1:
            err_d = max(err_d, (out_d[row:row + nq] - ref).abs().max().item())
        row += nq
    record("attention_prefill_paged_gqa", err_p, 2e-3)
    record("attention_decode_split_k", err_d, 2e-3)

    # Greedy sampling
    logits = L("sample_logits")
    mism = (L("sample_greedy").long() != logits.argmax(-1)).sum().item()
    record("sample_greedy_mismatches", float(mism), 0.0)

    ok = all(r["ok"] for r in results.values())
    json.dump({"ok": ok, "checks": results, "torch": torch.__version__}, open(out_path, "w"), indent=1)
    print("all kernel checks passed" if ok else "SOME KERNEL CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
