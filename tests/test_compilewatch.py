"""compilewatch: Dynamo graphs and Triton kernel compiles counted between two snapshots."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from colora.record import compilewatch


def test_a_dynamo_compile_counts_once_and_a_call_of_the_same_shape_not_at_all():
    def double(x):
        return torch.sin(x) * 2

    fn = torch.compile(double, backend="eager")  # a fresh function: its first call compiles
    before = compilewatch.snapshot()
    fn(torch.randn(3))
    assert compilewatch.since(before) == {"dynamo": 1}
    again = compilewatch.snapshot()
    fn(torch.randn(3))
    assert compilewatch.since(again) == {}
    fn(torch.randn(3, dtype=torch.float64))  # a guard fails: a recompile is one more graph, and why
    got = compilewatch.since(again)
    assert got["dynamo"] == 1 and len(got["recompiles"]) == 1
    assert got["recompiles"][0].startswith("double: ") and "dtype mismatch" in got["recompiles"][0]
    assert "recompiled as double: " in compilewatch.describe(got)
    later = compilewatch.snapshot()
    fn(torch.randn(3, dtype=torch.float64))
    assert compilewatch.since(later) == {}  # reasons already reported are not reported again


def test_a_frame_without_tensor_work_is_no_graph():
    """Dynamo's frames["ok"] counts such frames; a count of compiles must not."""
    def same(x):
        return x

    before = compilewatch.snapshot()
    torch.compile(same, backend="eager")(torch.randn(3))
    assert compilewatch.since(before) == {}


@pytest.fixture
def fresh_hook(monkeypatch):
    """A process without the watcher, whose Triton already has a hook of someone else's; both are
    put back afterwards. Returns the calls that earlier hook saw."""
    knobs = pytest.importorskip("triton").knobs
    seen = []

    def previous(**kwargs):
        seen.append(kwargs)
        return "previous hook's result"

    monkeypatch.setattr(compilewatch, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", previous)
    return seen


def _compiled(name: str, **extra):
    """Call the hook the way Triton's JITFunction._call_hook does after a compile."""
    import triton

    fn = SimpleNamespace(module="colora.kernels.lora.shrink", name=name, jit_function=None)  # a JitFunctionInfo
    return triton.knobs.runtime.jit_post_compile_hook(key="k", repr=f"{name}[num_warps=4]()", fn=fn,
                                                      compile={"key": "k", "num_warps": 4},
                                                      is_manual_warmup=False, already_compiled=False, **extra)


def test_the_triton_hook_counts_each_kernel_and_hands_on_to_an_earlier_hook(fresh_hook):
    assert compilewatch.install() and compilewatch.install()  # the second does nothing
    before = compilewatch.snapshot()
    assert _compiled("lora_shrink_kernel") == "previous hook's result"
    _compiled("lora_shrink_kernel")
    _compiled("lora_expand_kernel", inductor_args={})  # a keyword of another release passes through
    assert compilewatch.since(before) == {"triton": 3, "kernels": {"lora_shrink_kernel": 2, "lora_expand_kernel": 1}}
    assert [c["fn"].name for c in fresh_hook] == ["lora_shrink_kernel", "lora_shrink_kernel", "lora_expand_kernel"]
    assert fresh_hook[2]["inductor_args"] == {} and fresh_hook[0]["compile"]["num_warps"] == 4


def test_a_snapshot_is_a_fixed_record(fresh_hook):
    compilewatch.install()
    before = compilewatch.snapshot()
    _compiled("logsoftmax_kernel")
    after = compilewatch.snapshot()
    _compiled("logsoftmax_kernel")
    assert compilewatch.since(before, after) == {"triton": 1, "kernels": {"logsoftmax_kernel": 1}}
    with pytest.raises(AttributeError):
        after.triton = 0


def test_a_failed_specialisation_record_does_not_fail_the_compile(fresh_hook):
    """With a hook set, Triton serialises each compile's specialisation to JSON first; a constexpr
    JSON cannot hold must not turn counting into a failed kernel launch."""
    from triton.runtime import jit

    compilewatch.install()
    opts = SimpleNamespace(num_warps=4)
    assert jit.serialize_specialization_data("k", {}, {(0,): object()}, {}, opts, "key", SimpleNamespace()) is None
    assert jit.serialize_specialization_data("k", {}, {(0,): 3}, {}, opts, "key", SimpleNamespace()).startswith("{")


def test_without_triton_knobs_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(compilewatch, "_installed", False)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now fails, as without knobs
    assert compilewatch.install() is False
    assert compilewatch.since(compilewatch.snapshot()) == {}


def test_describe_names_kernels_by_count_and_dynamo_graphs():
    c = {"triton": 3, "dynamo": 1, "kernels": {"lora_reduce_kernel": 1, "lora_shrink_kernel": 2}}
    assert compilewatch.describe(c) == "Triton: lora_shrink_kernel x2, lora_reduce_kernel x1; Dynamo: 1 graph"
    assert compilewatch.describe({"dynamo": 2}) == "Dynamo: 2 graphs"
    assert compilewatch.describe({}) == ""
