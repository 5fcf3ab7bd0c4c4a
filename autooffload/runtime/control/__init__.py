"""The plan controller: the plan a runtime runs, the profiling steps it is searched from, the
calibration against the planned steps' measurements, and the OOM retry's smaller plan."""
