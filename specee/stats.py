"""The statistics every decoding strategy fills, so CLI, server and benchmarks treat them alike."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

MAX_LOGGED_SWITCHES = 32  # a long answer may switch hundreds of times; the first ones explain it


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_passes: int = 0  # forward passes of the target model after prefill
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per pass, bonus included
    position_proposed: list[int] = field(default_factory=list)  # [k]: passes with a k+1-th draft token
    position_reached: list[int] = field(default_factory=list)  # [k]: ... whose positions < k were all accepted
    position_accepted: list[int] = field(default_factory=list)  # [k]: ... where position k was accepted too
    exit_layers: list[int] = field(default_factory=list)  # layer count used per token (early exit)
    weight_bytes: int = 0  # weight bytes read by every model pass (target + drafter)
    draft_s: float = 0.0  # time spent drafting (inside decode_s)
    verify_s: float = 0.0  # time spent in the target's verification passes (inside decode_s)
    draft_nodes: int = 0  # draft tokens sent to verification (every tree node)
    # Early exit: time in exit features, predictors and full-head checks (inside decode_s), how
    # many predictor decisions ran, how many fired a full-head check and how many checks agreed.
    predictor_s: float = 0.0
    predictors_run: int = 0
    exit_checks: int = 0
    exit_checks_agreed: int = 0
    # Passes by the method that drafted them ("none": a pass with nothing drafted, a dense step).
    method_passes: dict[str, int] = field(default_factory=dict)
    # `auto`: how often its choice of method changed between passes, and the first changes, each
    # with the measured acceptance and cost behind it (Switch.to_dict).
    switches: int = 0
    switch_log: list[dict] = field(default_factory=list)
    # `auto`: per drafter it chose ("none": a dense step), {"passes", "drafted", "accepted",
    # "branches"}: the passes it drafted the chain of, the draft tokens it sent to verification and
    # those verification accepted (the last pass's may run past the answer's end, where
    # draft_tokens_accepted stops), and the passes it drafted a second branch in (its tokens counted too).
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: the first token comes from prefill, the other n - 1 from decode_s."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target pass, counting the bonus token (vLLM/SGLang convention)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Chance that draft position k is accepted given that position k - 1 was (and k drafted)."""
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    def ctar(self, w: int) -> float:
        """Kangaroo's consistent token acceptance rate: among passes that drafted at least w
        tokens, the fraction whose first w draft tokens were all accepted."""
        if len(self.position_proposed) < w or not self.position_proposed[w - 1]:
            return 0.0
        return self.position_accepted[w - 1] / self.position_proposed[w - 1]

    @property
    def drafting_share(self) -> float:
        """The share of decode time spent drafting."""
        return self.draft_s / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def draft_cost_per_token(self) -> float:
        """Drafting time per draft token, relative to one verification pass of the target."""
        if not self.draft_nodes or not self.verify_s:
            return 0.0
        return (self.draft_s / self.draft_nodes) / (self.verify_s / self.target_passes)

    @property
    def bytes_per_token(self) -> float:
        return self.weight_bytes / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def avg_forward_layers(self) -> float | None:
        """Layers run per pass with early exit (None without)."""
        return sum(self.exit_layers) / len(self.exit_layers) if self.exit_layers else None

    @property
    def exit_histogram(self) -> dict[int, int]:
        """How many passes ran each number of layers."""
        return dict(sorted(Counter(self.exit_layers).items()))

    @property
    def predictor_share(self) -> float:
        return self.predictor_s / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def predictors_per_token(self) -> float:
        return self.predictors_run / len(self.exit_layers) if self.exit_layers else 0.0

    @property
    def check_agreement(self) -> float | None:
        """Share of full-head checks whose argmax was a candidate (None: no check ran)."""
        return self.exit_checks_agreed / self.exit_checks if self.exit_checks else None

    def record_method(self, method: str) -> None:
        self.method_passes[method] = self.method_passes.get(method, 0) + 1

    def record_drafter(self, drafter: str, drafted: int, accepted: int, branch: bool = False) -> None:
        counts = self.drafters.setdefault(drafter, {"passes": 0, "drafted": 0, "accepted": 0, "branches": 0})
        counts["branches" if branch else "passes"] += 1
        counts["drafted"] += drafted
        counts["accepted"] += accepted

    def record_switch(self, explain: Callable[[], dict]) -> None:
        """A change of drafting method; `explain()` gives its record, asked for only while the log
        has room (it costs a share of a pass, and long answers switch hundreds of times)."""
        self.switches += 1
        if len(self.switch_log) < MAX_LOGGED_SWITCHES:
            self.switch_log.append(explain())

    def record_pass(self, proposed: int, accepted: int) -> None:
        """One verification pass: `proposed` draft tokens along the checked path(s), `accepted`
        of them kept; the pass adds accepted + 1 tokens (the bonus)."""
        self.target_passes += 1
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.accept_lengths.append(accepted + 1)
        for k in range(proposed):
            if k >= len(self.position_proposed):
                self.position_proposed.append(0)
                self.position_reached.append(0)
                self.position_accepted.append(0)
            self.position_proposed[k] += 1
            self.position_reached[k] += k <= accepted
            self.position_accepted[k] += k < accepted

    def to_dict(self) -> dict:
        """The fields, then every figure derived from them."""
        figures = {name: getattr(self, name) for name in DERIVED}
        figures["ctar"] = {w: self.ctar(w) for w in range(1, 7)}  # a method: DERIVED holds its place only
        return asdict(self) | figures


# What to_dict adds to the fields, in this order.
DERIVED = ("tokens_per_s", "mean_acceptance_length", "per_position_acceptance", "ctar", "drafting_share",
           "draft_cost_per_token", "bytes_per_token", "avg_forward_layers", "exit_histogram", "predictor_share",
           "predictors_per_token", "check_agreement")
