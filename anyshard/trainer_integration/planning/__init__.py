"""Planning that imports no trainer: the failure simulator behind `anyshard plan`, and the
step-time model of a layout (`step_cost`) that the trainer's layout chooser calibrates."""
