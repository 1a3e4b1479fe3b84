"""One check shared by the isolation and fidelity tests: two AdamW states are the same job's state.

Adapter weights alone are a weak witness of a step: AdamW's first update is about lr * sign(gradient),
whatever the gradient's size, so a 2% change of one job's advantages moved its weights by 8.3e-7
(measured on the tiny model, tests/test_trainer.py's jobs) while its first moment moved by 2%. The
moments carry the gradient itself: exp_avg = (1 - beta1) g and exp_avg_sq = (1 - beta2) g^2 after one
step.
"""

from __future__ import annotations


def assert_same_adamw_state(got: dict, want: dict, rel: float = 1e-5) -> None:
    """got, want: `optimizer.state_dict()`s. Same parameters, same step counts, and exp_avg and
    exp_avg_sq equal to `rel` of each tensor's largest magnitude (after one fp32 step, sums in
    another order left them ~1e-6 of it apart; a 0.01% change of the gradient moves exp_avg by 1e-4)."""
    got, want = got["state"], want["state"]
    assert got.keys() == want.keys() and want, (sorted(got), sorted(want))
    for i in want:
        assert float(got[i]["step"]) == float(want[i]["step"]) > 0, (i, got[i]["step"], want[i]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            g, w = got[i][key], want[i][key]
            assert g.shape == w.shape, (i, key, g.shape, w.shape)
            scale = w.abs().max().item()
            diff = (g - w).abs().max().item()
            assert diff <= rel * scale, f"parameter {i} {key}: differs by {diff:.3g}, {diff / max(scale, 1e-300):.3g} of its largest {scale:.3g}"
    assert any(want[i]["exp_avg"].abs().max() > 0 for i in want), "no gradient reached the optimizer"

