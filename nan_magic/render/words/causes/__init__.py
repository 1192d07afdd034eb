"""The sentences of a cause, one module a family of readings: readings (the registry, cause_hint and
cause_evidence, the optimizer and upstream readings), forward_ops, overflow, without_op_rule, domain_edges, and
phrases (the event read back, the phrases all of them share)."""
