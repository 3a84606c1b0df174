"""Installed as ddtree._native by a build without CUDA (see meson.build): importing it says why it is absent."""

raise ImportError("ddtree._native is not built: ddtree was installed without a CUDA compiler (nvcc); install the "
                  "CUDA toolkit (nvcc >= 12) and reinstall ddtree to use the GPU engine (the numpy reference "
                  "backend, --backend reference, runs without it)")
