"""Penalties, logit bias and logprobs on the CUDA path, on a tiny random model (no file needed):
greedy speculative output with penalties against dense with them, the largest difference between
their log-probabilities, and dense decoding's speed with and without them, then one JSON line with
what each mode decoded with (passes by method, draft tokens). Run from the checkout root:
`python benchmarks/cuda_penalties_logprobs.py` (BENCHMARKS.md has an H100's figures)."""
import json, subprocess, sys, tempfile, time
from pathlib import Path
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"cuda_penalties_logprobs.py needs a CUDA GPU; PyTorch {torch.__version__} sees none")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import tiny_hf_model, tiny_tokenizer
from specee.engine import Engine
from specee.model.loading import LoadedWeights, build_model
from specee.model.config import LlamaConfig

print(torch.cuda.get_device_name(), torch.__version__)
print(subprocess.run("lscpu | grep -E 'Model name|Flags' | cut -c1-200", shell=True, capture_output=True, text=True).stdout)
tok = tiny_tokenizer(Path(tempfile.mkdtemp()))
hf = tiny_hf_model(5, vocab_size=tok.vocab_size, num_hidden_layers=3)
config = LlamaConfig.from_dict(hf.config.to_dict())
state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
model = build_model(LoadedWeights(config, state, None), torch.float32, "cuda")
engine = Engine(model, tok)
prompt = "the cat sat on the mat. the cat sat on the"
pen = dict(presence_penalty=-2.0, frequency_penalty=0.5, logit_bias={17: 1.5})
modes = {}  # mode -> what it decoded with: spec_method, passes by method, draft tokens


def ran(name, method, result):
    mode = modes.setdefault(name, {"spec_method": method, "method_passes": {}, "drafted": 0})
    for m, passes in result.stats.method_passes.items():
        mode["method_passes"][m] = mode["method_passes"].get(m, 0) + passes
    mode["drafted"] += result.stats.draft_tokens_proposed
    return result


for name, method, spec in (("draft chain self:3", "draft", dict(draft_model="self:3", num_draft_tokens=3)),
                           ("draft tree self:3", "draft", dict(draft_model="self:3", tree="0;1;0,0;0,1;1,0")),
                           ("prompt-lookup", "prompt-lookup", {})):
    dense = ran("dense", "none", engine.generate(prompt, max_tokens=48, ignore_eos=True, logprobs=2, spec_method="none", **pen))
    fast = ran(name, method, engine.generate(prompt, max_tokens=48, ignore_eos=True, logprobs=2, spec_method=method, **pen, **spec))
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(dense.logprobs, fast.logprobs))
    modes[name] |= {"greedy_identical": dense.token_ids == fast.token_ids, "largest_logprob_difference": diff}
    print(f"{name}: greedy identical {dense.token_ids == fast.token_ids}, accepted {fast.stats.draft_tokens_accepted}, "
          f"largest logprob difference {diff:.2e}")
sampled = ran("sampled draft tree self:2", "draft", engine.generate(
    prompt, max_tokens=32, ignore_eos=True, temperature=0.9, seed=1, **pen, spec_method="draft", draft_model="self:2",
    tree="0;1;0,0"))
print("sampled speculative with penalties on cuda:", sampled.completion_tokens, "tokens")
speeds = {}
for label, options in (("plain", {}), ("penalties+bias", pen), ("logprobs=5", dict(logprobs=5))):
    engine.generate(prompt, max_tokens=64, ignore_eos=True, spec_method="none", **options)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(5):
        ran("dense", "none", engine.generate(prompt, max_tokens=64, ignore_eos=True, spec_method="none", **options))
    torch.cuda.synchronize()
    speeds[f"dense, {label}"] = 5 * 64 / (time.perf_counter() - t)
    print(f"dense, {label}: {speeds[f'dense, {label}']:.0f} tok/s")
print(json.dumps({"device": torch.cuda.get_device_name(), "modes": modes, "tokens_per_s": speeds}))
