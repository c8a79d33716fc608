"""Kernel generators: ``cpu/`` emits LLVM IR (llvmlite) for the host CPU."""
