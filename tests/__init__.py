"""The test suite (a package, so its folders never shadow installed packages such as triton)."""
