"""The layout chooser: candidate layouts, the step-time cost model's calibration, the online scheduler."""
