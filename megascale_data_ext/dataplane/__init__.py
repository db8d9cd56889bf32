"""The data plane: pure Python/numpy planning (no Ray, no torch), testable in one process."""
