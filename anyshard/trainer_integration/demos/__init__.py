"""The demos of `anyshard demo` and the loopback S3 server they and the tests start."""
