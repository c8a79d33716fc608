"""Lowering: schedule, memory plan and code generation of an IR graph, and the runtime
that runs the result (:class:`egraft.lowering.runtime.CompiledModel`)."""
