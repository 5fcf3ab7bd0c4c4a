"""The planner: measured profiles in, the fastest plan that fits the budget out (pure)."""
