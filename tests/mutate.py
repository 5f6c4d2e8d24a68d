"""Mutation check: does the correctness suite catch deliberately broken decoders?

    python tests/mutate.py [--only NAME] [-- extra pytest args]

Each mutant is one textual edit of spec/decode.py, applied to a copy of the
repository in a temporary folder (the checkout is never touched). The suite runs
there with -x; a mutant is "caught" when pytest fails, and the first failing test
is printed. Not collected by pytest (no test_ prefix): it runs the suite itself.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (what a real bug would look like, old text, new text[, file]); the file is spec/decode.py
# unless named.
MUTANTS = {
    "accept-one-too-many": ("off-by-one: one more draft token accepted than agreed",
                            "k = int((proposed == choice[:g]).cumprod(0).sum())",
                            "k = min(g, int((proposed == choice[:g]).cumprod(0).sum()) + 1)", "spec/accept.py"),
    "accept-one-too-few": ("off-by-one: the last agreeing draft token dropped (output stays exact)",
                           "k = int((proposed == choice[:g]).cumprod(0).sum())",
                           "k = max(0, int((proposed == choice[:g]).cumprod(0).sum()) - 1)", "spec/accept.py"),
    "bonus-from-draft": ("the token after the accepted prefix taken from the draft",
                         "return k, choice[k]", "return k, proposed[k] if k < g else choice[k]", "spec/accept.py"),
    "sampled-accept-non-strict": ("a sampled proposal kept when u = p(x) / q(x) exactly",
                                  "passed = u * q[rows, proposed] < p[rows, proposed]",
                                  "passed = u * q[rows, proposed] <= p[rows, proposed]", "spec/accept.py"),
    "sampled-no-residual": ("after a rejection the next token drawn from p, not norm(max(0, p - q))",
                            "return k, (sampling.residual(p[k], q[k]) if k < g else p[g])", "return k, p[k]",
                            "spec/accept.py"),
    "no-target-rollback": ("rejected positions left in the target's cache",
                           "        target_run.crop([n[b] - 1 for b in live])\n", ""),
    "target-rollback-one-short": ("target cache cropped one position too far",
                                  "target_run.crop([n[b] - 1 for b in live])", "target_run.crop([n[b] - 2 for b in live])"),
    "no-draft-rollback": ("rejected positions left in the draft's cache (output stays exact)",
                          "        self.run.crop([n[b] - 1 for b in live])    # all but each row's newest token, fed next round",
                          "        pass", "spec/draft.py"),
    "draft-skips-catch-up": ("draft fed only the newest token, never the bonus it missed (output stays exact)",
                             "feeds = [seq[b, length:n[b] + i] for b, length in zip(live, self.run.lengths)]",
                             "feeds = [seq[b, n[b] + i - 1:n[b] + i] for b in live]", "spec/draft.py"),
    "eos-only-at-round-end": ("EOS honoured only as the last token of a round",
                              "cut = _first_stop(seq[n[b]:n[b] + k + 1].tolist(), stops) if stops else None",
                              "cut = k if int(seq[n[b] + k]) in stops else None"),
    "eos-ignored": ("EOS never stops generation (plain or speculative, one prompt or a batch)",
                    "cut = _first_stop(seq[n[b]:n[b] + k + 1].tolist(), stops) if stops else None",
                    "cut = None"),
    "max-new-overshoot": ("gamma not capped by the tokens left: up to gamma extra tokens",
                          "gs = [min(policies[b].gamma, max_new_tokens - (n[b] - P[b]) - 1) for b in live]",
                          "gs = [policies[b].gamma for b in live]"),
    "draft-full-width": ("draft proposals over its whole head, not the range both models share",
                         "self.run(feeds, keep=1).logits[:, -1, :self.width]", "self.run(feeds, keep=1).logits[:, -1]",
                         "spec/draft.py"),
    "no-draft-clamp": ("ids the draft cannot embed fed to it anyway",
                       "clamp=hf.logit_width(target) > rows", "clamp=False", "spec/choose.py"),
    # EOS lists (issue 35); tests/correctness/test_edges.py's test_eos_lists_stop_where_hf_generate_stops.
    # One loop serves plain and speculative decoding, so one cut covers both.
    "eos-list-first-only": ("an EOS list read as its first id alone",
                            "        return frozenset(ids)\n", "        return frozenset(list(ids)[:1])\n",
                            "spec/validate.py"),
    "eos-list-one-id": ("a round stops only on the largest id of an EOS list (plain and speculative)",
                        "    return next((i for i, t in enumerate(tokens) if t in stops), None)",
                        "    return next((i for i, t in enumerate(tokens) if t == max(stops)), None)"),
    "stats-count-bonus": ("accepted count includes the bonus token",
                          "min(accepted[j], emitted[j])", "min(accepted[j] + 1, emitted[j])"),
    "plain-draft-not-rolled-back": ("the plain draft's KV buffer keeps rejected positions (output stays exact)",
                                    "self.len = min(self.len, keep)", "pass", "spec/neox.py"),
    "plain-draft-rotary-from-zero": ("the plain draft rotates new tokens as if they stood at position 0",
                                     "cos, sin = self.cos[start:end], self.sin[start:end]",
                                     "cos, sin = self.cos[:T], self.sin[:T]", "spec/neox.py"),
    "plain-draft-kv-off-by-one": ("the plain draft writes keys one position late",
                                  "self.k[i, 0, :, start:end] = qk[:, :, 1].transpose(0, 1)",
                                  "self.k[i, 0, :, start + 1:end + 1] = qk[:, :, 1].transpose(0, 1)",
                                  "spec/neox.py"),
    "plain-draft-rotary-from-bf16-positions": ("the plain draft's rotary table computed from positions held in the "
                                               "model's dtype (bf16 rounds 257 to 256; output stays exact)",
                                               "freqs = torch.arange(max_len, device=self.device, dtype=torch.float)",
                                               "freqs = torch.arange(max_len, device=self.device, dtype=self.dtype).float()",
                                               "spec/neox.py"),
    "autogamma-flat-verify": ("gamma=auto prices the verify pass flat at its current time (climbs on CPU)",
                              "        slope = max(0.0, sxy / (max(sxx, 0.0) + SLOPE_PRIOR))\n",
                              "        slope = 0.0\n", "spec/autogamma.py"),
    "autogamma-unshrunk-slope": ("gamma=auto fits the verify line to a few noisy rounds (gamma fell to 1 on CPU)",
                                 "SLOPE_PRIOR = 25.0", "SLOPE_PRIOR = 1e-9", "spec/autogamma.py"),
    "snapshot-not-restored": ("a recurrent state left as it is after a rejection (state-snapshot path)",
                              "            self.len, self.cache = at, cache\n", "            self.len = at\n",
                              "spec/runner.py"),
    "snapshot-copy-stays-behind": ("a rollback leaves the kept tokens to the next pass, so the state copy never "
                                   "moves past the last fully accepted round (output stays exact)",
                                   "            if keep > at:\n                self._feed(self.held[at:keep], 1)\n",
                                   "", "spec/runner.py"),
    "per-row-pick-ignored": ("every row of a batch accepted by the first row's options (greedy or sampled)",
                             "processors[b],\n                             picks[b], target_run, j)",
                             "processors[b],\n                             picks[0], target_run, j)"),
    "tree-path-kept-in-place": ("a tree's accepted path taken to lie in place behind the sequence (no compaction)",
                                "    return path == list(range(len(path)))", "    return True", "spec/tree.py"),
    "probe-trusts-kv-cache": ("every model run on the KV path unchecked (recurrent, sliding, cache-less alike)",
                              '    return probing.once(model, "path", _probe, remember=(UnsupportedModelError,))',
                              '    return RunnerPath.KV_CACHE, "explicit"', "spec/runner.py"),
    "kv-cache-from-config": ("the model's own sliding-window cache, cropped past its window",
                             "    return DynamicCache()\n", "    return DynamicCache(config=model.config)\n",
                             "spec/hf.py"),
    "static-cache-not-rolled-back": ("the compiled draft's static cache keeps its write position after a rejection",
                                     "layer.cumulative_length.fill_(min(keep, int(layer.cumulative_length)))",
                                     "pass", "spec/hf.py"),
    # Batches (spec/batch.py and the batched loop); tests/correctness/test_batch.py catches them.
    "batch-crop-in-place": ("a row's crop cuts its columns where they are, not re-aligned with the others",
                            "[self.width - d - width for d in drop]",
                            "[self.width - max(drop) - width for d in drop]", "spec/batch.py"),
    "batch-refeed-one-short": ("a row re-fed one token too few to fill the pass",
                               "back = [M - f.numel() for f in fed]",
                               "back = [max(0, M - f.numel() - 1) for f in fed]", "spec/batch.py"),
    "batch-tree-path-not-moved": ("a batch row's accepted tree path left where its nodes were in the shared cache",
                                  "        if in_place(path):\n            return                                  # the crop that follows keeps it",
                                  "        if True:\n            return", "spec/batch.py"),
    "tree-sibling-q-whole": ("a sampled tree's sibling claimed drawn from its parent's whole distribution",
                             "                q.append(dist)", "                q.append(pick.probabilities(scores[i]))",
                             "spec/draft.py"),
    "batch-rows-draft-together": ("every row drafts only what the row nearest its end may (output stays exact)",
                                  "trees = drafter.draft(seq, n, gs, live)",
                                  "trees = drafter.draft(seq, n, [min(gs)] * len(gs), live)"),
    "batch-finished-rows-stay": ("a finished row is never dropped from the caches",
                                 "        for run in runs:\n            run.select(going)",
                                 "        for run in runs:\n            pass"),
    "batch-logits-left-aligned": ("a row's verify logits read from the left of the kept block",
                                  "logits[j, logits.shape[1] - drafted[j] - 1:]",
                                  "logits[j, :drafted[j] + 1]"),
    # spec.cpu.qdraft's quantized draft forward; tests/test_qdraft.py catches them.
    "qdraft-kv-head-modulo": ("the draft's grouped attention reads key head 0 for every group of query heads",
                              "spec_attend_blocked(q, G, hd, qd_kblock(m, l, j, 0),",
                              "spec_attend_blocked(q, G, hd, qd_kblock(m, l, j % 1, 0),", "spec/cpu/native/qdraft.c"),
    "qdraft-last-key-block-dropped": ("the draft's scores skip the last, part-full block of 16 keys",
                                      "for (int64_t b = 0; b * 16 < n; b++) {\n        const float *k = kb",
                                      "for (int64_t b = 0; b * 16 + 16 <= n; b++) {\n        const float *k = kb",
                                      "spec/cpu/native/layer.c"),
    "qdraft-key-block-transposed": ("a key is stored position-major in its block, read d-major",
                                    "for (int64_t d = 0; d < hd; d++) kb[d * 16] = k[d];",
                                    "for (int64_t d = 0; d < hd; d++) kb[d + (p % 16) * (hd - 1)] = k[d];",
                                    "spec/cpu/native/qdraft.c"),
    "attend-kv-head-modulo": ("the target's grouped attention reads KV head h % n_kv instead of h / group",
                              "const int64_t j = h / (H / KV), n", "const int64_t j = h % KV, n",
                              "spec/cpu/native/layer.c"),
    "qdraft-fill-strides-swapped": ("the fill reads a layer's input a position's stride along, not a layer's",
                                    "spec_rms(hidden + l * ls + (c0 + r) * rs,", "spec_rms(hidden + l * rs + (c0 + r) * ls,",
                                    "spec/cpu/native/qdraft.c"),
    "qdraft-fill-one-q-panel-left": ("the fill's key and value product starts one panel early, in q's rows",
                                     "m->mats[4 * l] + (D / 16) * (D / 32)", "m->mats[4 * l] + (D / 16 - 1) * (D / 32)",
                                     "spec/cpu/native/qdraft.c"),
    "executor-states-one-layer-late": ("the executor keeps each layer's output in the next layer's place",
                                       "copy_into(states[:, :, i + 1], x, serial)",
                                       "copy_into(states[:, :, min(i + 2, len(self.layers))], x, serial)",
                                       "spec/cpu/executor.py"),
    "hidden-view-gap-doubled": ("the view of states lying side by side steps two layers at a time",
                                "(first.stride(0), gap, first.stride(1))", "(first.stride(0), 2 * gap, first.stride(1))",
                                "spec/hf.py"),
    "accept-argmax-rows-shifted": ("the CPU's row-by-row argmax scores each proposal with the next row",
                                   "return torch.stack([row.argmax() for row in logits])",
                                   "return torch.stack([row.argmax() for row in logits[1:]] + [logits[-1].argmax()])",
                                   "spec/accept.py"),
    "serial-residual-dropped": ("a split pass's residual add on the calling thread drops the residual",
                                "np.add(x.numpy(), y.numpy(), out=out.numpy())",
                                "np.add(0 * x.numpy(), y.numpy(), out=out.numpy())", "spec/cpu/plainllama.py"),
    "attend-split-drops-last-head": ("the attention's split over threads leaves the last key head undone",
                                     "j1 = a->KV * (part + 1) / parts, D", "j1 = a->KV * (part + 1) / parts - (part == parts - 1), D",
                                     "spec/cpu/native/layer.c"),
    "qdraft-rope-chunk-position": ("every row of a prefill block rotated at the block's first position",
                                   "const float f = (float)(p0 + r) * powf", "const float f = (float)(p0) * powf",
                                   "spec/cpu/native/qdraft.c"),
    "qdraft-nibbles-swapped": ("a Q4_1 block's high and low nibbles read the other way round",
                               "u = np.concatenate([qs & 15, qs >> 4], axis=-1)",
                               "u = np.concatenate([qs >> 4, qs & 15], axis=-1)", "spec/cpu/qdraft.py"),
    "qdraft-crop-one-short": ("the draft's cache cut back one position short (a rejected proposal kept)",
                              "self.n = min(self.n, max(0, keep))", "self.n = min(self.n, max(0, keep + 1))",
                              "spec/cpu/qdraft.py"),
    "qdraft-exp-coefficient": ("the vector exponential's first-order coefficient off (0.60 for ln 2)",
                               "p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));",
                               "p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.0e-01f));", "spec/cpu/native/vexp.h"),
    # spec.cpu.gemv's pool: a worker's part of a split product; its self-test and tests/correctness/test_gemv.py.
    "gemv-split-skips-a-panel": ("a worker's part of a product split over threads skips its first panel",
                                 "n0 = P * part / parts * 16,", "n0 = P * part / parts * 16 + (part ? 16 : 0),",
                                 "spec/cpu/native/gemv.c"),
    "gemv-pool-shared-by-two-callers": ("two caller threads put their products on the pool at once",
                                        "if (parts <= 1 || atomic_flag_test_and_set(&pool_busy)) {",
                                        "if (parts <= 1) {", "spec/cpu/native/pool.c"),
    # spec.cpu.plainllama's decoder layers; tests/correctness/test_plainllama.py catches them.
    "plainllama-rotary-sign": ("the plain layers' rotate-half without its minus sign",
                               "torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
                               "torch.cat((x[..., half:], x[..., :half]), dim=-1)", "spec/cpu/plainllama.py"),
    "plainllama-mask-dropped": ("the plain layers' attention ignores the mask (a verify pass sees ahead)",
                                "attn_mask=mask, scale=scale", "attn_mask=None, scale=scale",
                                "spec/cpu/plainllama.py"),
    "plainllama-causal-mask-top-left": ("rows fed after a cache see only as many keys as a prefill's",
                                        "torch.ones(T, L, dtype=torch.bool).tril(L - T)",
                                        "torch.ones(T, L, dtype=torch.bool).tril(0)", "spec/cpu/plainllama.py"),
    "plainllama-second-norm-is-first": ("the MLP's RMSNorm reads the attention norm's weight",
                                        "h = norm(x, n2.weight, n2.variance_epsilon)",
                                        "h = norm(x, n1.weight, n1.variance_epsilon)", "spec/cpu/plainllama.py"),
    # spec.cpu.executor; tests/correctness/test_executor.py and test_plainllama.py catch them.
    "executor-hooks-ignored": ("a hook on one of the model's modules bypassed by the executor",
                               "        return self._modules_decline()", "        return None",
                               "spec/cpu/executor.py"),
    "executor-rotary-rows-from-zero": ("the rotary tables read from position 0 whatever the positions fed",
                                       "index = position_ids[0]", "index = position_ids[0] - position_ids[0, 0]",
                                       "spec/cpu/executor.py"),
    "executor-pass-state-shared": ("a pass's cache kept on the executor, shared by two threads' passes",
                                   "x = layer(x, mask, cos, sin, cache, kernel, serial)",
                                   "self._cache = cache\n                x = layer(x, mask, cos, sin, self._cache, "
                                   "kernel, serial)", "spec/cpu/executor.py"),
    "hf-serial-append-order": ("the one-thread cache append puts the new keys before the held ones",
                               "np.concatenate((held.detach().numpy(), new.detach().numpy()), axis=-2, out=",
                               "np.concatenate((new.detach().numpy(), held.detach().numpy()), axis=-2, out=",
                               "spec/hf.py"),
    "gemv-rotary-sign": ("the library's rotary adds b sin where transformers subtracts it",
                         "lo_s = -b * s[i]", "lo_s = b * s[i]", "spec/cpu/native/layer.c"),
    "gemv-attend-mask-ignored": ("the library's attention ignores the model's mask (a verify pass sees ahead)",
                                 "if (p >= see || (m && !m[p])) sr[p] = -INFINITY;",
                                 "if (p >= see) sr[p] = -INFINITY;", "spec/cpu/native/layer.c"),
    "attend-row-sees-next-key": ("a row of the blocked attention sees the key after its own position",
                                 "see = mask ? L : L - T + t + 1;", "see = mask ? L : L - T + t + 2;",
                                 "spec/cpu/native/layer.c"),
    "attend-part-block-not-repacked": ("keys packed as later rows reach them start mid-block, not at its start",
                                       "const int64_t from = packed / 16 * 16;", "const int64_t from = packed;",
                                       "spec/cpu/native/layer.c"),
    "attend-transpose-halves-swapped": ("the 16 x 16 transpose puts columns 8-15 where 0-7 go",
                                        "r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);",
                                        "r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);", "spec/cpu/native/layer.c"),
    "attend-output-row-of-next-head": ("a row's output written to the next query head's place",
                                       "memcpy(out + ((t0 + r / G) * H + j * G + r % G) * D,",
                                       "memcpy(out + ((t0 + r / G) * H + (j * G + r % G + 1) % H) * D,",
                                       "spec/cpu/native/layer.c"),
    "gemv-rms-no-eps": ("the library's RMSNorm leaves eps out",
                        "sqrtf(ss / (float)n + eps)", "sqrtf(ss / (float)n)", "spec/cpu/native/layer.c"),
    # spec/cpu/native/: one bug per variant, tail, split, block layout, position and cache edge; the library's
    # self-test (run before any use, under the sanitizers too) and the native tests catch them.
    "native-avx2-tail-writes-16": ("the AVX2 panel's last, partly filled panel writes all 16 outputs",
                                   "for (int64_t j = 0; j < w; j++) out[m * N + j] = t[j];",
                                   "for (int64_t j = 0; j < 16; j++) out[m * N + j] = t[j];", "spec/cpu/native/gemv.c"),
    "native-avx512-rows-tail-short": ("the AVX-512 rows kernel's masked tail drops its last input",
                                      "__mmask16 mask = (__mmask16)((1u << (K - k)) - 1);",
                                      "__mmask16 mask = (__mmask16)((1u << (K - k - 1)) - 1);", "spec/cpu/native/gemv.c"),
    "native-panel-row-block-short": ("a long pass's block of rows stops one row short of the next block",
                                     "const int64_t m1 = j->M - m0 < block ? j->M : m0 + block;",
                                     "const int64_t m1 = j->M - m0 < block ? j->M : m0 + block - 1;",
                                     "spec/cpu/native/gemv.c"),
    "native-plain-panel-width": ("the plain-C panel writes a whole panel past N",
                                 "int64_t w = N - n0 < 16 ? N - n0 : 16;\n        for (int64_t m = 0; m < M; m++) {\n            float acc",
                                 "int64_t w = 16;\n        for (int64_t m = 0; m < M; m++) {\n            float acc",
                                 "spec/cpu/native/gemv.c"),
    "native-qd-split-drops-a-panel": ("a worker's part of a quantized product stops one panel short",
                                      "p1 = P * (part + 1) / parts, K = j->K",
                                      "p1 = P * (part + 1) / parts - (part > 0), K = j->K", "spec/cpu/native/qdraft.c"),
    "native-q4-nibbles-plain": ("the plain-C quantized kernel reads a Q4 byte's nibbles the other way round",
                                "return hi ? byte >> 4 : byte & 15;", "return hi ? byte & 15 : byte >> 4;",
                                "spec/cpu/native/qdraft.c"),
    "native-q4-nibbles-vnni": ("the VNNI kernel shifts a Q4 byte's high nibble by 3",
                               "w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);",
                               "w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 3), lo);", "spec/cpu/native/qdraft.c"),
    "native-last-cache-slot-refused": ("the draft's forward refuses the last slot of its cache",
                                       "return n > 0 && pos0 >= 0 && pos0 + n <= m->n_ctx;",
                                       "return n > 0 && pos0 >= 0 && pos0 + n < m->n_ctx;",
                                       "spec/cpu/native/qdraft.c"),
    "native-plain-attend-mask-ignored": ("the plain-C attention ignores the mask",
                                         "s[l] = m && !m[l] ? -INFINITY : a;", "s[l] = a;", "spec/cpu/native/layer.c"),
    "native-silu-sign": ("the scalar SiLU's exponential without its minus",
                         "for (; i < inner; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];",
                         "for (; i < inner; i++) o[i] = g[i] / (1.f + expf(g[i])) * u[i];", "spec/cpu/native/layer.c"),
    "native-rms-tail-dropped": ("RMSNorm's sum of squares drops the inputs past the last 16",
                                "for (; i < n; i++) ss += xr[i] * xr[i];", "", "spec/cpu/native/layer.c"),
    "native-rotary-high-half": ("rotary's second half subtracts where it adds",
                                "v[i + half] = hi_c + hi_s;", "v[i + half] = hi_c - hi_s;", "spec/cpu/native/layer.c"),
    "native-pool-last-part-skipped": ("the pool's last worker skips its part",
                                      "if (id < pool.parts) {", "if (id < pool.parts - 1) {", "spec/cpu/native/pool.c"),
    "native-q8-offset": ("a Q8_0 block's int8 read with 127 added instead of 128",
                         "u = (blk[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)",
                         "u = (blk[..., 2:34].view(np.int8).astype(np.int16) + 127).astype(np.uint8)", "spec/cpu/qdraft.py"),
    "native-qk-rows-not-unpermuted": ("q's and k's rows left in llama.cpp's interleaved order",
                                      "return raw.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)",
                                      "return raw", "spec/cpu/qdraft.py"),
    "native-exp-clamp": ("the vector exponential clamps its input at 8 instead of 88",
                         "x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-104.f));",
                         "x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(8.f)), _mm512_set1_ps(-104.f));",
                         "spec/cpu/native/vexp.h"),
    # Encoder-decoder runners (spec/seq2seq.py); tests/correctness/test_encoder_decoder.py catches them.
    "seq2seq-no-decoder-rollback": ("rejected positions left in the decoders' self-attention caches",
                                    "hf.crop(self.cache.self_attention_cache, keep)", "pass", "spec/seq2seq.py"),
    "seq2seq-crop-one-too-many": ("decoder caches cropped one position too far",
                                  "hf.crop(self.cache.self_attention_cache, keep)",
                                  "hf.crop(self.cache.self_attention_cache, keep - 1)", "spec/seq2seq.py"),
    "seq2seq-draft-reads-target-encoder": ("a draft with its own encoder fed the target's encoder output "
                                           "(output stays exact)",
                                           "out = encode(models[name], input_ids, input_features, name=name)",
                                           "out = target_out", "spec/seq2seq.py"),
    "seq2seq-shared-encoder-zeroed": ("share_encoder=True feeds the draft a zeroed encoder output (output stays exact)",
                                      "last_hidden_state=target_out.last_hidden_state.to(",
                                      "last_hidden_state=0 * target_out.last_hidden_state.to(", "spec/seq2seq.py"),
    "qdraft-chunk-positions-off-by-one": ("a prefill's later chunks placed one position early (cache and rotary)",
                                          "const int64_t R = n - c0 < CHUNK ? n - c0 : CHUNK, p0 = pos0 + c0;",
                                          "const int64_t R = n - c0 < CHUNK ? n - c0 : CHUNK, p0 = pos0 + (c0 ? c0 - 1 : 0);",
                                          "spec/cpu/native/qdraft.c"),
    "prepack-copy-where-the-kernel-runs": ("oneDNN's reordered copy made beside the kernel's panels (a third copy)",
                                           "return self.reorder and (self.small is None or torch.get_num_threads() > KERNEL_THREADS)",
                                           "return self.reorder", "spec/cpu/prepack.py"),
    "prepack-copy-for-long-passes": ("oneDNN's copy made for a prefill's long pass, where the plain weight is as fast",
                                     "if reordered is None and rows <= REORDER_ROWS and self._copy_pays()",
                                     "if reordered is None and self._copy_pays()", "spec/cpu/prepack.py"),
    "prepack-drop-without-compare": ("a mapped weight's pages dropped without checking that the file holds its values",
                                     "                if disk != values[at:at + len(disk)].tobytes():\n                    return False",
                                     "                if disk != values[at:at + len(disk)].tobytes():\n                    pass",
                                     "spec/cpu/prepack.py"),
    "prepack-shed-long-pass-onednn": ("a shed weight's long passes left on oneDNN, which reads the weight back",
                                      "if threads and rows and (rows <= self.most or self.shed and long_on_kernel(threads)):\n            return self.small",
                                      "if threads and rows and rows <= self.most:\n            return self.small",
                                      "spec/cpu/prepack.py"),
    "prepack-shed-file-not-mapped": ("a weight written to its file but its Parameter left in memory",
                                     "        param.data = copy.view(t.shape)", "        pass", "spec/cpu/prepack.py"),
    "qdraft-cache-on-huge-pages": ("the draft's key cache allocated by numpy, which asks for huge pages",
                                   "self.kc: np.ndarray | None = _zeros((layers, kv, -(-n_ctx // 16), hd, 16))",
                                   "self.kc: np.ndarray | None = np.zeros((layers, kv, -(-n_ctx // 16), hd, 16), np.float32)",
                                   "spec/cpu/qdraft.py"),
    "qdraft-gguf-pages-kept": ("the GGUF's mapped pages kept after its records are made",
                               "                mm.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(mm)) - lo)",
                               "                pass", "spec/cpu/qdraft.py"),
    "qdraft-fill-positions-off-by-one": ("a filled cache's keys rotated and stored one position late",
                                         "qd_store(m, l, kv, KV2, rows, pos0 + c0, cs, sn);",
                                         "qd_store(m, l, kv, KV2, rows, pos0 + c0 + 1, cs, sn);",
                                         "spec/cpu/native/qdraft.c"),
    "gguf-draft-fills-from-the-wrong-layers": ("the draft's cache made from each layer's output, not its input",
                                               "self.layers = tuple(range(run.model.n_layer))",
                                               "self.layers = tuple(range(1, run.model.n_layer + 1))", "spec/gguf_draft.py"),
    "gguf-draft-waits-forever": ("a draft asked again with no prompt states handed waits again (no proposals for good)",
                                 "self._waiting, self._gave_up = None, True", "self._waiting = None",
                                 "spec/gguf_draft.py"),
    # The kit's two properties (spec/conformance/checks.py) and what they stand on; the kit's own tests
    # (tests/test_conform_*.py, the default --impl run of spec/conformance) catch them.
    "kit-greedy-ignores-divergence": ("greedy exactness never judges a divergence (every output passes)",
                                      "rows.append(Compared(k, list(p), want, got, subject.judge(list(p), want.ids, got.ids, noise)))",
                                      "rows.append(Compared(k, list(p), want, got, None))",
                                      "spec/conformance/checks.py"),
    "kit-greedy-compares-reference-to-itself": ("the side under test never asked: the reference judged against itself",
                                                "got = subject.test.complete(list(p), n, **request)",
                                                "got = subject.reference.complete(list(p), n, **request)",
                                                "spec/conformance/checks.py"),
    "kit-law-fits-shifted-tokens": ("the sampling law fitted to the tokens after the first one",
                                    "samples = [tuple(ids[:depth]) for ids in drawn]",
                                    "samples = [tuple(ids[1:depth + 1]) for ids in drawn]",
                                    "spec/conformance/checks.py"),
    "kit-judge-scores-after-wrong-prefix": ("a served divergence judged by the reference's gap one token early",
                                            "self.scores(list(prompt) + list(expected[:i]), noise,",
                                            "self.scores(list(prompt) + list(expected[:max(0, i - 1)]), noise,",
                                            "spec/conformance/subject.py"),
    "kit-declared-ignores-draft": ("a user's conformance_draft ignored",
                                   'draft = given.get("draft", "model")', 'draft = "model"',
                                   "spec/conformance/subject.py"),
}


def run(name: str, pytest_args: list[str]) -> tuple[bool, str]:
    why, old, new, *where = MUTANTS[name]
    path = where[0] if where else "spec/decode.py"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".hypothesis",
                                                                  ".pytest_cache", ".benchmarks", "spec-results"))
        target = copy / path
        src = target.read_text()
        if src.count(old) != 1:
            return False, f"mutation text not found exactly once in {path}: {old!r}"
        target.write_text(src.replace(old, new))
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header",
               "-m", "not gpu and not thorough and not perf", *pytest_args]
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        last = proc.stdout.strip().splitlines()
        return proc.returncode != 0, (failed[0] if failed else last[-1] if last
                                      else f"pytest ended with return code {proc.returncode} and no output (a crash)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(MUTANTS), help="run just this mutant")
    parser.add_argument("pytest_args", nargs="*", default=["tests/correctness"])
    args = parser.parse_args()
    missed = 0
    for name in args.only or MUTANTS:
        caught, detail = run(name, args.pytest_args)
        missed += not caught
        print(f"{'CAUGHT' if caught else 'MISSED'}  {name:28s} {MUTANTS[name][0]}\n        {detail}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
