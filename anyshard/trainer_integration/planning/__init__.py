"""Planning that imports no trainer: the failure simulator behind `anyshard plan`."""
