"""The on-disk format: the manifest, data files and their checksums, the commit, and storage
(local paths and fsspec URLs). No planning: what to read is decided in anyshard.reshard."""
