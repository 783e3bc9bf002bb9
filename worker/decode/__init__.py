"""GRPO's batched decoder: every row of a step (batch_size prompts x group_size) decodes together.

Why not mlx_lm's generate/batch_generate: GRPO needs each sampled token's log-prob under the
distribution it was drawn from (logits / temperature) and its entropy, and no host sync per
token. So the KV cache is a fixed-size buffer: shapes never change while decoding, and the whole
decode step (model forward, filtering, sampling, EOS bookkeeping) is one `mx.compile`d function.

On a GPU a decode step costs about its number of MLX primitives (host work per primitive, not
arithmetic), so the step keeps that number down: what all layers share (positions, mask, write
slot) is computed once, and on CUDA each layer's attention and KV write is one kernel (a Qwen3
layer's q/k norms and RoPE too; elsewhere the attention sees each row's query twice so that MLX
fuses it), each projection group's LoRA product two, a quantized matmul of few rows one, a
quantized embedding's lookup one, and a Qwen3 block's residual adds and the norms after them one
each, its MLP activation one, its rows 2-D; the norm and activation kernels also run the LoRA
kernels next to them. bench/decode.py counts them (on a CPU as a CUDA GPU would build them);
docs/performance.md has the figures.

Where each part lives:

  sampling.py          sample (the loop: prefill, chunks of decode steps, dropping finished rows)
                       and make_decode_step (the compiled step), kernel_fits, compacted
  draw.py              SamplingParams, Samples, and draw (the next token, its log-prob, entropy)
  kv_cache.py          Slots, StaticKVCache, KernelMisfit: the fixed-size KV buffers
  graph_patches.py     the context managers that swap mlx / mlx_lm functions while a step is
                       traced (decode_attention, decode_blocks, grouped_projections), Handoff,
                       lora_args, dequantized
  *_kernel.py          the CUDA kernels: attention, embed, lora, norm, quantized, swiglu
  custom_kernel.py     kernel: how each of them is made (mx.fast.cuda_kernel, kept per source)
  ptx_cache.py         seed: each kernel's module put into MLX's PTX cache before MLX needs it
                       (MLX compiles custom kernels in every process), mlx_source, std_hash

What model loading and memory planning share with the decoder lives in worker/runtime/, so that
neither loads it: projection_groups.py (fuse_shared_inputs, decode_groups), backend.py (cuda),
logprobs.py (token_logprobs, lm_head, attention_mask, left_pad).
"""
