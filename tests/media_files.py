"""Small videos for the video tests, encoded and decoded with PyAV (the decoder the
tokenizer stage uses)."""

from __future__ import annotations

import io

import numpy as np

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


def solid_video(colours: list[tuple[int, int, int]] = COLOURS, side: int = 56, fps: int = 4,
                container_format: str = "mp4", codec: str = "mpeg4") -> bytes:
    """One solid colour per frame, side x side px. An mp4 states its frame count; a webm
    (codec libvpx) does not, so its frames are counted by decoding."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for colour in colours:
            frame = np.full((side, side, 3), colour, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def decoded_frames(data: bytes) -> np.ndarray:
    """Every frame of a video, as RGB: [T, H, W, 3]."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
