"""The GPU kit: built here with network (`gpu_kit_build`), installed there on a GPU machine without it (`gpu_kit`,
standard library alone). It measures nothing and imports none of the other sub-packages."""
