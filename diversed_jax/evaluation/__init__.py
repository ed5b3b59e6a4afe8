"""The main job as a library: config checks, method grids, evaluation, reports."""
