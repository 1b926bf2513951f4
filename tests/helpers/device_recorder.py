"""A device-placement recorder: a rank's CUDA branches run on CPU, and any call that would put work
on another rank's GPU fails the run.

`install(rank, world)` makes this process look like one rank of a `world`-GPU box: `torch.cuda`
reports `world` devices, keeps a current device per thread as CUDA does (a new thread starts on
device 0) and hands out streams and events that remember their device; every tensor call that
names a device (`device=`, `.to(...)`, `.cuda()`) is checked, then runs on the CPU. A call fails
(`WrongDevice`, raised in the thread that made it) when it

- names a bare "cuda": device 0 in any thread but the main one of a rank set up by the launcher,
- names, or resolves through the thread's current device to, a GPU other than this rank's,
- queries or uses the current device (streams, events, synchronize, memory statistics) from a
  thread whose current device is not this rank's.

torch's own FSDP2 runs on a CPU mesh (its collectives go over gloo); colorl's `make_mesh` is
checked to ask for a "cuda" mesh. Everything colorl does on the rank's device goes through here.
"""
from __future__ import annotations

import contextlib
import threading
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode


class WrongDevice(AssertionError):
    pass


class _Stream:
    def __init__(self, recorder: "DeviceRecorder", device: torch.device):
        self.recorder, self.device = recorder, device
        self.device_index = device.index

    def wait_event(self, event) -> None:
        self.recorder.require(event.device, "Stream.wait_event")

    def wait_stream(self, stream) -> None:
        self.recorder.require(stream.device, "Stream.wait_stream")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, recorder: "DeviceRecorder"):
        self.recorder, self.device = recorder, None

    def record(self, stream=None) -> None:
        stream = stream or self.recorder.current_stream()
        self.device = self.recorder.require(stream.device, "Event.record")

    def wait(self, stream=None) -> None:
        self.recorder.require((stream or self.recorder.current_stream()).device, "Event.wait")

    def synchronize(self) -> None:
        assert self.device is not None, "Event.synchronize before record"

    def query(self) -> bool:
        return True


class DeviceRecorder(TorchFunctionMode):
    """This rank's view of the box: `rank`'s GPU is the only one it may touch."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world
        self.own = torch.device("cuda", rank)
        self._threads = threading.local()
        self.checked = 0  # device-naming calls checked (a test asserts the recorder saw work)

    # -- what a thread has current
    def current_index(self) -> int:
        return getattr(self._threads, "device", 0)

    def current_stream(self, device=None) -> _Stream:
        resolved = self.require(device, "current_stream")
        streams = getattr(self._threads, "streams", None)
        if streams:
            return streams[-1]
        return _Stream(self, resolved)

    # -- the check
    def require(self, device, call: str) -> torch.device:
        """The device `device` resolves to in this thread (None or an int index: the current
        device), failing unless it is this rank's."""
        self.checked += 1
        if device is None:
            resolved = torch.device("cuda", self.current_index())
            how = f"the thread's current device (cuda:{self.current_index()})"
        elif isinstance(device, int):
            resolved, how = torch.device("cuda", device), f"cuda:{device}"
        else:
            named = torch.device(device)
            if named.type == "cuda" and named.index is None:
                self._fail(f"{call} names a bare 'cuda' (device {self.current_index()} in this thread, "
                           f"which only the launcher's set_device made right): name the rank's device")
            resolved, how = named, str(named)
        if resolved != self.own:
            self._fail(f"{call} uses {how}, not rank {self.rank}'s {self.own}")
        return resolved

    def _fail(self, message: str) -> None:
        thread = threading.current_thread().name
        raise WrongDevice(f"device recorder, rank {self.rank}, thread {thread!r}: {message}\n"
                          + "".join(traceback.format_stack(limit=12)[:-2]))

    def _placed(self, value, call: str):
        """A device argument, checked and replaced by the CPU; anything else as it is."""
        if isinstance(value, torch.device) or (isinstance(value, str) and value.startswith("cuda")):
            if torch.device(value).type == "cuda":
                self.require(value, call)
                return torch.device("cpu")
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.device:  # naming a device places nothing
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.cuda:
            self.require(args[1] if len(args) > 1 else kwargs.get("device"), "Tensor.cuda")
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            self.require(args[1].device, "Tensor.record_stream")
            return None
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if isinstance(kwargs.get("device"), int):  # an index: a CUDA device
            self.require(kwargs["device"], name)
            kwargs["device"] = torch.device("cpu")
        elif "device" in kwargs:
            kwargs["device"] = self._placed(kwargs["device"], name)
        args = tuple(self._placed(a, name) for a in args)
        return func(*args, **kwargs)

    # -- torch.cuda, as this rank sees it
    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None:
            self._fail(f"set_device({device!r}) names no device")
        self._threads.device = index
        self.require(index, "set_device")

    @contextlib.contextmanager
    def stream(self, stream):
        """As torch.cuda.stream: the stream's device becomes current for the block."""
        if stream is None:
            yield
            return
        previous = self.current_index()
        self._threads.device = stream.device.index
        self._threads.streams = [*getattr(self._threads, "streams", []), stream]
        try:
            yield
        finally:
            self._threads.streams = self._threads.streams[:-1]
            self._threads.device = previous

    def functions(self) -> dict:
        """Replacements for the torch.cuda functions a rank calls."""
        def query(name, value):
            def call(device=None):
                self.require(device, f"torch.cuda.{name}")
                return value
            return call

        def stream_init(stream, device=None, priority=0, **kwargs):
            _Stream.__init__(stream, self, self.require(device, "torch.cuda.Stream"))

        def event_init(event, **kwargs):
            _Event.__init__(event, self)

        gib = 1 << 30
        return {
            "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: self.world,
            "set_device": self.set_device, "current_device": lambda: self.require(None, "current_device").index,
            "Stream": type("Stream", (_Stream,), {"__init__": stream_init}), "stream": self.stream,
            "current_stream": self.current_stream, "Event": type("Event", (_Event,), {"__init__": event_init}),
            "synchronize": query("synchronize", None), "empty_cache": lambda: query("empty_cache", None)(),
            "mem_get_info": query("mem_get_info", (gib // 8, gib // 4)), "memory_allocated": query("memory_allocated", 0),
            "memory_reserved": query("memory_reserved", 0), "max_memory_allocated": query("max_memory_allocated", 0),
            "reset_peak_memory_stats": query("reset_peak_memory_stats", None),
            "get_rng_state": query("get_rng_state", torch.get_rng_state()),
            "set_rng_state": lambda state, device=None: query("set_rng_state", None)(device),
        }


def install(monkeypatch, rank: int, world: int) -> DeviceRecorder:
    """The recorder in this process, in every thread started from now on (patches undone by
    `monkeypatch.undo()`)."""
    recorder = DeviceRecorder(rank, world)
    for name, function in recorder.functions().items():
        monkeypatch.setattr(torch.cuda, name, function)
    original_run = threading.Thread.run

    def run(thread):
        with recorder:
            original_run(thread)

    monkeypatch.setattr(threading.Thread, "run", run)
    from colorl.train import fsdp
    init_device_mesh = fsdp.init_device_mesh

    def cpu_mesh(device_type, shape):
        assert device_type == "cuda", f"make_mesh asked for a {device_type!r} mesh on a CUDA rank"
        return init_device_mesh("cpu", shape)

    monkeypatch.setattr(fsdp, "init_device_mesh", cpu_mesh)
    recorder.__enter__()
    return recorder


def on_own_gpu(rank_fn, rank: int, world: int, cfg_dict: dict, run_dir: str, resume: bool, device: str,
               report_dir: str) -> None:
    """`rank_fn` (a checked rank: colorl doctor's, or the SGLang stand-in's) as rank `rank` of a
    `world`-GPU box under the recorder: the launcher's CUDA set-up (the rank's device current on
    the main thread, device "cuda"), then the whole run on CPU. A spawned process's target."""
    recorder = install(pytest.MonkeyPatch(), rank, world)
    torch.cuda.set_device(rank)  # init_process_group's choice for rank `rank` on a CUDA box
    rank_fn(rank, world, cfg_dict, run_dir, resume, "cuda", report_dir)
    assert recorder.checked > 0, "the recorder saw no device call: the CUDA branches did not run"
