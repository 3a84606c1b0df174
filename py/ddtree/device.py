"""What this machine and installation can run on: CUDA device discovery through cuda-python (cuda.bindings),
independent of the native module, and whether the native module was built (a build without nvcc skips it)."""

from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import runtime as cudart


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    name: str
    compute_capability: tuple[int, int]
    multiprocessors: int
    total_memory_bytes: int
    l2_cache_bytes: int


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    devices: tuple[Device, ...]
    driver_version: int | None
    runtime_version: int | None
    reason: str | None = None

    def __str__(self) -> str:
        if not self.devices:
            return f"no CUDA device is present ({self.reason})"
        lines = [f"CUDA driver {_version(self.driver_version)}, runtime {_version(self.runtime_version)}"]
        for d in self.devices:
            lines.append(
                f"  [{d.index}] {d.name}: sm_{d.compute_capability[0]}{d.compute_capability[1]}, "
                f"{d.multiprocessors} SMs, {d.total_memory_bytes / 2**30:.1f} GiB, "
                f"L2 {d.l2_cache_bytes / 2**20:.0f} MiB"
            )
        return "\n".join(lines)


def _version(v: int | None) -> str:
    return "unknown" if v is None else f"{v // 1000}.{(v % 1000) // 10}"


def _ok(err: object) -> bool:
    return err == cudart.cudaError_t.cudaSuccess


def device_info() -> DeviceInfo:
    """Report the CUDA devices, or say plainly why there are none."""
    err, driver = cudart.cudaDriverGetVersion()
    driver_version = driver if _ok(err) and driver > 0 else None
    err, runtime = cudart.cudaRuntimeGetVersion()
    runtime_version = runtime if _ok(err) else None
    if driver_version is None:
        return DeviceInfo((), None, runtime_version, "no CUDA driver is installed")
    err, count = cudart.cudaGetDeviceCount()
    if not _ok(err) or count == 0:
        reason = "the driver reports no device" if _ok(err) else cudart.cudaGetErrorString(err)[1].decode()
        return DeviceInfo((), driver_version, runtime_version, reason)
    devices = []
    for index in range(count):
        err, prop = cudart.cudaGetDeviceProperties(index)
        if not _ok(err):
            continue
        devices.append(
            Device(
                index=index,
                name=prop.name.split(b"\0", 1)[0].decode(),
                compute_capability=(prop.major, prop.minor),
                multiprocessors=prop.multiProcessorCount,
                total_memory_bytes=prop.totalGlobalMem,
                l2_cache_bytes=prop.l2CacheSize,
            )
        )
    return DeviceInfo(tuple(devices), driver_version, runtime_version)


def has_cuda_device() -> bool:
    return bool(device_info().devices)


def native_unavailable() -> str | None:
    """Why ddtree._native cannot be imported (the ImportError's message), or None when it can."""
    try:
        import ddtree._native  # noqa: F401
    except ImportError as e:
        return str(e)
    return None
