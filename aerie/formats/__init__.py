"""Captured-traffic record formats: parsers (auto-detected per line), the normalised record,
the Data Capture writer, and chat-template encoding with loss masks."""

from aerie.formats.capture import DataCaptureWriter, capture_event, format_time
from aerie.formats.chat import STATUS_OK, STATUS_TOO_LONG, ChatEncoder, Encoded
from aerie.formats.parse import detect_format, parse_line, parse_object, parse_request, parse_response
from aerie.formats.record import Message, Reason, Record, RecordError

__all__ = [
    "ChatEncoder",
    "DataCaptureWriter",
    "Encoded",
    "Message",
    "Reason",
    "Record",
    "RecordError",
    "STATUS_OK",
    "STATUS_TOO_LONG",
    "capture_event",
    "detect_format",
    "format_time",
    "parse_line",
    "parse_object",
    "parse_request",
    "parse_response",
]
