"""The chain engine every dsv41 fusion family runs on.

How a family recognises a chain (docs/ARCHITECTURE.md "Pipeline stages" 2): it finds a candidate region by
STRUCTURE (an anchor op, the tensors the region depends on, their shapes and dtypes — never module or parameter
names: `graph`, `region`), then checks the region's SEMANTICS by evaluating the region's own ATen nodes on probe
tensors (`evaluate`) and comparing the result with the fused op's reference semantics (`tolerance`). Inductor's
traced patterns ignore every int, float, list and dtype argument, so on their own they cannot tell "RoPE on the
last R channels" from "on the first R", an exponent bias of 127 from 100, or a 32-element block from a 16-element
one; evaluating the region settles exactly those constants (`literals` lists the candidates), whichever way eager
code spelled the math. A check that fails becomes a `NearMiss` naming it. `loop` runs finders, op checks, rewrites,
dead-code elimination, toposort and records; `traffic` is the default byte rule; `chain` holds the declarations a
family's chains are described by, which the registry (passes/registry.py) reads.

Modules: graph (node facts, op classes), symbolic (run-time sizes), evaluate (probe evaluation), region (growth and
cut search), literals, tolerance, casts, edit (inserting nodes, undo), traffic (bytes), loop (the chain loop),
family (`FusionFamily`; `ChainFamily`, a family as data on the chain loop; `HorizontalFamily`, one that merges ops
of one input), chain (`FamilySpec` / `Chain` declarations).
"""

from .casts import FP32_EXACT, PASS_THROUGH, casts_after, chain_back, exact_cast
from .chain import Chain, FamilySpec, Role, describe_families, fused_ops, register_family, unvalidated_ops
from .edit import GraphFingerprint, insert_node, restore_graph, size_args, snapshot_graph
from .evaluate import RegionEvaluator, RegionNotClosed, collect_region, probe_runs, real_tensors
from .family import ChainFamily, FusionFamily, HorizontalFamily
from .graph import (call_arg, concrete_shape, dsv41_op, dtype_of, eliminate_dead_code, group_by_key, group_in_order,
                    is_dataflow_op, is_float, is_reshape, is_shape_value, is_small_constant, is_step, is_table_lookup,
                    is_view_op, node_label, positions, same_shape, shape_of, size_hint, sourced_nodes, static_inputs,
                    tensor_val, token_rows)
from .literals import discover, eps_candidates, float_literals, int_literals
from .loop import (GraphScan, Site, collect, finish_graph, import_kernels, keep_removed, match_record, ops_or_note,
                   pass_record, records_of, resolve_replaced, rewrite_outputs, run_finders, sort_region)
from .region import ancestors_within, backward_distances, closed_region, cut_search, ranked, walk_forward, walk_inputs
from .symbolic import static_refusal, symbolic_part
from .tolerance import (agree_where_representable, close, close_exact, close_rounded, close_scaled, randn_probe,
                        rms_eps_reason, rms_norm_eps_outside, wide_scale_probes)
from .traffic import ByteTally, op_inputs, per_token_closure

__all__ = [
    "FP32_EXACT", "PASS_THROUGH", "casts_after", "chain_back", "exact_cast", "Chain", "FamilySpec", "Role",
    "describe_families", "fused_ops", "register_family", "unvalidated_ops", "GraphFingerprint",
    "insert_node", "restore_graph", "size_args", "snapshot_graph", "RegionEvaluator", "RegionNotClosed",
    "collect_region", "probe_runs", "real_tensors", "ChainFamily", "FusionFamily", "HorizontalFamily", "call_arg",
    "concrete_shape", "dsv41_op", "dtype_of", "eliminate_dead_code", "group_by_key", "group_in_order", "is_dataflow_op",
    "is_float", "is_reshape", "is_shape_value", "is_small_constant", "is_step", "is_table_lookup", "is_view_op",
    "node_label",
    "positions", "same_shape", "shape_of", "size_hint", "sourced_nodes", "static_inputs", "tensor_val", "token_rows",
    "discover", "eps_candidates", "float_literals", "int_literals", "GraphScan", "Site", "collect", "finish_graph",
    "import_kernels", "keep_removed", "match_record", "ops_or_note", "pass_record", "records_of", "resolve_replaced",
    "rewrite_outputs", "run_finders", "sort_region", "ancestors_within", "backward_distances", "closed_region",
    "cut_search", "ranked", "walk_forward", "walk_inputs", "static_refusal", "symbolic_part",
    "agree_where_representable", "close", "close_exact", "close_rounded", "close_scaled", "randn_probe",
    "rms_eps_reason", "rms_norm_eps_outside", "wide_scale_probes", "ByteTally", "op_inputs", "per_token_closure",
]
