"""Grammar-constrained sampling in the worker (see manager.py for why it lives here)."""
from worker.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
