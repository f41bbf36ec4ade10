"""Modules eaglenest puts on the path of the SGLang servers it starts on a CPU (this directory is
added to their PYTHONPATH): `sgl_kernel`, a compatibility module without kernels.  Nothing here is
imported by eaglenest itself."""
