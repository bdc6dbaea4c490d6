#!/usr/bin/env python3
"""Hugging Face transformers `generate` on the same synthetic Llama-3-8B shapes as bench_cuda
(random init, bf16, greedy), at batch 64 by default, beside the Tessera numbers.

Nothing is downloaded: the model is built from a LlamaConfig with random weights directly on
the GPU. Writes a JSON with transformers' tokens/s, Tessera's (read from bench_cuda's JSON,
same prompt length and number of new tokens) and the ratio (target: Tessera >= 5x).

usage: hf_compare.py --tessera bench_cuda.json --out hf_compare.json [--batch 64]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", help="bench_cuda JSON (for prompt length, new tokens, Tessera tok/s)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()

    tessera = {}
    if args.tessera:
        try:
            with open(args.tessera) as f:
                tessera = json.load(f)
            args.prompt = int(tessera.get("prompt_len", args.prompt))
            args.new_tokens = int(tessera.get("new_tokens", args.new_tokens))
            args.layers = int(tessera.get("layers", args.layers))
        except (OSError, ValueError) as e:
            print(f"cannot read {args.tessera}: {e}; comparing without Tessera numbers", file=sys.stderr)

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=torch.bfloat16).eval()
    torch.set_default_dtype(torch.float32)
    init_s = time.time() - t0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
          f"random bf16 model in {init_s:.1f} s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda", generator=gen)
    mask = torch.ones_like(ids)

    def run(new_tokens):
        torch.cuda.synchronize()
        t = time.time()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        torch.cuda.synchronize()
        assert out.shape[1] == args.prompt + new_tokens, out.shape
        return time.time() - t

    run(2)  # warm-up
    prefill_s = run(1)
    total_s = run(args.new_tokens)
    hf_e2e = args.batch * args.new_tokens / total_s
    hf_decode = args.batch * (args.new_tokens - 1) / max(1e-9, total_s - prefill_s)
    print(f"transformers generate, batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens: "
          f"{total_s:.2f} s, {hf_e2e:.0f} tok/s end to end, {hf_decode:.0f} tok/s decode", flush=True)

    result = {
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(0), "batch": args.batch, "prompt_len": args.prompt,
        "new_tokens": args.new_tokens, "layers": args.layers,
        "hf_total_s": total_s, "hf_prefill_s": prefill_s,
        "hf_end_to_end_tok_s": hf_e2e, "hf_decode_tok_s": hf_decode,
    }
    if tessera and args.batch == 64:
        t_e2e = tessera.get("end_to_end_b64_tok_s")
        t_dec = tessera.get("decode_b64_tok_s")
        result.update({
            "tessera_end_to_end_tok_s": t_e2e, "tessera_decode_tok_s": t_dec,
            "speedup_end_to_end": (t_e2e / hf_e2e) if t_e2e else None,
            "speedup_decode": (t_dec / hf_decode) if t_dec else None,
            "target_speedup": 5.0,
        })
        print(f"Tessera / transformers at batch 64: {result['speedup_end_to_end']:.2f}x end to end, "
              f"{result['speedup_decode']:.2f}x decode (target 5x)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
