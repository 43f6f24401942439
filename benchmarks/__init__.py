"""Benchmarks, run on demand (never in tests); each prints JSON and the peer comparisons write it.

    python -m benchmarks.train --json OUT       train step vs transformers + torch AdamW (+ MFU on accelerators)
    python -m benchmarks.decode --json OUT      greedy decode vs transformers `generate`, same weights
    python -m benchmarks.retrieval --n N --dim D --json OUT   ScaNN vs exact search (+ encoder, datastore)
    python -m benchmarks.construct --json OUT   Algorithm 1 on SmolLM2 with real questions vs an earlier commit's code
    python -m benchmarks.eval --json OUT        SeaKR's decisions on SmolLM2 with real questions vs an earlier commit's
    python -m benchmarks.reading                how fast reading comprehension emerges in the tiny model
    python -m benchmarks.attention --json OUT   the decoder's attention path (cuDNN on GPUs) vs XLA, numbers and time
    python -m benchmarks.fit --config CFG --json OUT   the plan's programs run on the devices present: peak, s/call, MFU
"""
