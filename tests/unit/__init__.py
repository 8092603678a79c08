"""Single-process unit tests of mpidp's pure logic (no MPI)."""
