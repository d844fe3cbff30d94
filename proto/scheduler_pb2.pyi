from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Protocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_UNSPECIFIED: _ClassVar[Protocol]
    PROTOCOL_UNARY: _ClassVar[Protocol]
    PROTOCOL_STREAM: _ClassVar[Protocol]
    PROTOCOL_LEASES: _ClassVar[Protocol]

class ServiceClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_CLASS_UNSPECIFIED: _ClassVar[ServiceClass]
    INTERACTIVE: _ClassVar[ServiceClass]
    BATCH: _ClassVar[ServiceClass]

class RunStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STAGE_UNSPECIFIED: _ClassVar[RunStage]
    IDLE: _ClassVar[RunStage]
    GENERATING: _ClassVar[RunStage]
    PAUSED: _ClassVar[RunStage]

class RefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_REASON_UNSPECIFIED: _ClassVar[RefusalReason]
    UNKNOWN_MODEL: _ClassVar[RefusalReason]
    MALFORMED: _ClassVar[RefusalReason]
    NO_HEALTHY_REPLICA: _ClassVar[RefusalReason]
    SATURATED: _ClassVar[RefusalReason]
PROTOCOL_UNSPECIFIED: Protocol
PROTOCOL_UNARY: Protocol
PROTOCOL_STREAM: Protocol
PROTOCOL_LEASES: Protocol
SERVICE_CLASS_UNSPECIFIED: ServiceClass
INTERACTIVE: ServiceClass
BATCH: ServiceClass
RUN_STAGE_UNSPECIFIED: RunStage
IDLE: RunStage
GENERATING: RunStage
PAUSED: RunStage
REFUSAL_REASON_UNSPECIFIED: RefusalReason
UNKNOWN_MODEL: RefusalReason
MALFORMED: RefusalReason
NO_HEALTHY_REPLICA: RefusalReason
SATURATED: RefusalReason

class AdmitRequest(_message.Message):
    __slots__ = ("turn_id", "run_id", "model", "service_class", "caller", "one_pass", "dataplane_id", "traceparent", "leased_replica", "allowed_replicas", "shed_batch_held")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ONE_PASS_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LEASED_REPLICA_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SHED_BATCH_HELD_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    model: str
    service_class: ServiceClass
    caller: str
    one_pass: bool
    dataplane_id: str
    traceparent: str
    leased_replica: str
    allowed_replicas: _containers.RepeatedScalarFieldContainer[str]
    shed_batch_held: int
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., model: _Optional[str] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ..., one_pass: _Optional[bool] = ..., dataplane_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., leased_replica: _Optional[str] = ..., allowed_replicas: _Optional[_Iterable[str]] = ..., shed_batch_held: _Optional[int] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("replica", "base_url", "api_key_env", "held_ms", "native_apis", "hints")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_ENV_FIELD_NUMBER: _ClassVar[int]
    HELD_MS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_APIS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    base_url: str
    api_key_env: str
    held_ms: int
    native_apis: _containers.RepeatedScalarFieldContainer[str]
    hints: EngineHints
    def __init__(self, replica: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key_env: _Optional[str] = ..., held_ms: _Optional[int] = ..., native_apis: _Optional[_Iterable[str]] = ..., hints: _Optional[_Union[EngineHints, _Mapping]] = ...) -> None: ...

class EngineHints(_message.Message):
    __slots__ = ("priority", "sessions", "slots", "slot")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    priority: str
    sessions: bool
    slots: int
    slot: int
    def __init__(self, priority: _Optional[str] = ..., sessions: _Optional[bool] = ..., slots: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class TurnStarted(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("ttft_ms",)
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: int
    def __init__(self, ttft_ms: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TurnFinished(_message.Message):
    __slots__ = ("finish_reason", "tool_call_ids", "token_us")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_US_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    tool_call_ids: _containers.RepeatedScalarFieldContainer[str]
    token_us: int
    def __init__(self, finish_reason: _Optional[str] = ..., tool_call_ids: _Optional[_Iterable[str]] = ..., token_us: _Optional[int] = ...) -> None: ...

class TurnFailed(_message.Message):
    __slots__ = ("error", "stalled")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    error: str
    stalled: bool
    def __init__(self, error: _Optional[str] = ..., stalled: _Optional[bool] = ...) -> None: ...

class TurnAbandoned(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunEnded(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TurnSilent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("turn_id", "run_id", "trace_id", "started", "first_token", "usage", "finished", "failed", "abandoned", "run_ended", "silent")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    RUN_ENDED_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    trace_id: str
    started: TurnStarted
    first_token: FirstToken
    usage: Usage
    finished: TurnFinished
    failed: TurnFailed
    abandoned: TurnAbandoned
    run_ended: RunEnded
    silent: TurnSilent
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., started: _Optional[_Union[TurnStarted, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finished: _Optional[_Union[TurnFinished, _Mapping]] = ..., failed: _Optional[_Union[TurnFailed, _Mapping]] = ..., abandoned: _Optional[_Union[TurnAbandoned, _Mapping]] = ..., run_ended: _Optional[_Union[RunEnded, _Mapping]] = ..., silent: _Optional[_Union[TurnSilent, _Mapping]] = ...) -> None: ...

class TurnEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TurnEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TurnEvent, _Mapping]]] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: int
    def __init__(self, events: _Optional[int] = ...) -> None: ...

class RunSnapshot(_message.Message):
    __slots__ = ("run_id", "replica", "stage", "service_class", "caller")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    replica: str
    stage: RunStage
    service_class: ServiceClass
    caller: str
    def __init__(self, run_id: _Optional[str] = ..., replica: _Optional[str] = ..., stage: _Optional[_Union[RunStage, str]] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ...) -> None: ...

class TurnSnapshot(_message.Message):
    __slots__ = ("turn_id", "run_id", "replica", "model", "service_class", "caller")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    replica: str
    model: str
    service_class: ServiceClass
    caller: str
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., replica: _Optional[str] = ..., model: _Optional[str] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("runs", "turns", "dataplane_id")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_ID_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunSnapshot]
    turns: _containers.RepeatedCompositeFieldContainer[TurnSnapshot]
    dataplane_id: str
    def __init__(self, runs: _Optional[_Iterable[_Union[RunSnapshot, _Mapping]]] = ..., turns: _Optional[_Iterable[_Union[TurnSnapshot, _Mapping]]] = ..., dataplane_id: _Optional[str] = ...) -> None: ...

class ResyncReply(_message.Message):
    __slots__ = ("runs", "turns")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    runs: int
    turns: int
    def __init__(self, runs: _Optional[int] = ..., turns: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol", "resync")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    protocol: Protocol
    resync: ResyncRequest
    def __init__(self, protocol: _Optional[_Union[Protocol, str]] = ..., resync: _Optional[_Union[ResyncRequest, _Mapping]] = ...) -> None: ...

class DataplaneItem(_message.Message):
    __slots__ = ("admit", "event", "returned")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    admit: AdmitRequest
    event: TurnEvent
    returned: LeaseReturn
    def __init__(self, admit: _Optional[_Union[AdmitRequest, _Mapping]] = ..., event: _Optional[_Union[TurnEvent, _Mapping]] = ..., returned: _Optional[_Union[LeaseReturn, _Mapping]] = ...) -> None: ...

class LeaseReturn(_message.Message):
    __slots__ = ("replica", "slots")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    slots: int
    def __init__(self, replica: _Optional[str] = ..., slots: _Optional[int] = ...) -> None: ...

class DataplaneFrame(_message.Message):
    __slots__ = ("hello", "items")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    items: _containers.RepeatedCompositeFieldContainer[DataplaneItem]
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., items: _Optional[_Iterable[_Union[DataplaneItem, _Mapping]]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol", "resync")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    protocol: Protocol
    resync: ResyncReply
    def __init__(self, protocol: _Optional[_Union[Protocol, str]] = ..., resync: _Optional[_Union[ResyncReply, _Mapping]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: RefusalReason
    message: str
    def __init__(self, reason: _Optional[_Union[RefusalReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("turn_id", "placed", "refused")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    placed: AdmitReply
    refused: Refusal
    def __init__(self, turn_id: _Optional[str] = ..., placed: _Optional[_Union[AdmitReply, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("replica", "slots", "base_url", "api_key_env", "models", "native_apis", "hints")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_ENV_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_APIS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    slots: int
    base_url: str
    api_key_env: str
    models: _containers.RepeatedScalarFieldContainer[str]
    native_apis: _containers.RepeatedScalarFieldContainer[str]
    hints: EngineHints
    def __init__(self, replica: _Optional[str] = ..., slots: _Optional[int] = ..., base_url: _Optional[str] = ..., api_key_env: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., native_apis: _Optional[_Iterable[str]] = ..., hints: _Optional[_Union[EngineHints, _Mapping]] = ...) -> None: ...

class LeaseRevoke(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class SchedulerFrame(_message.Message):
    __slots__ = ("welcome", "decisions", "grants", "revokes")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    REVOKES_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    grants: _containers.RepeatedCompositeFieldContainer[LeaseGrant]
    revokes: _containers.RepeatedCompositeFieldContainer[LeaseRevoke]
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., grants: _Optional[_Iterable[_Union[LeaseGrant, _Mapping]]] = ..., revokes: _Optional[_Iterable[_Union[LeaseRevoke, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("name", "base_url", "kind", "models", "healthy", "load_known", "running", "queued", "in_flight", "capacity", "batch_reserve", "kv_used_tokens", "kv_total_tokens", "decode_ceiling", "leased_idle", "stalled", "unseen", "silent", "hints", "turn_ms", "token_us", "interactive_runs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_KNOWN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BATCH_RESERVE_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CEILING_FIELD_NUMBER: _ClassVar[int]
    LEASED_IDLE_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    TURN_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_US_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_RUNS_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_url: str
    kind: str
    models: _containers.RepeatedScalarFieldContainer[str]
    healthy: bool
    load_known: bool
    running: int
    queued: int
    in_flight: int
    capacity: int
    batch_reserve: int
    kv_used_tokens: int
    kv_total_tokens: int
    decode_ceiling: int
    leased_idle: int
    stalled: bool
    unseen: bool
    silent: int
    hints: EngineHints
    turn_ms: int
    token_us: int
    interactive_runs: int
    def __init__(self, name: _Optional[str] = ..., base_url: _Optional[str] = ..., kind: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., healthy: _Optional[bool] = ..., load_known: _Optional[bool] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., capacity: _Optional[int] = ..., batch_reserve: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_total_tokens: _Optional[int] = ..., decode_ceiling: _Optional[int] = ..., leased_idle: _Optional[int] = ..., stalled: _Optional[bool] = ..., unseen: _Optional[bool] = ..., silent: _Optional[int] = ..., hints: _Optional[_Union[EngineHints, _Mapping]] = ..., turn_ms: _Optional[int] = ..., token_us: _Optional[int] = ..., interactive_runs: _Optional[int] = ...) -> None: ...

class HeldGroup(_message.Message):
    __slots__ = ("key", "count", "longest_wait_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LONGEST_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    count: int
    longest_wait_ms: int
    def __init__(self, key: _Optional[str] = ..., count: _Optional[int] = ..., longest_wait_ms: _Optional[int] = ...) -> None: ...

class RunGroup(_message.Message):
    __slots__ = ("stage", "service_class", "count")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    stage: str
    service_class: str
    count: int
    def __init__(self, stage: _Optional[str] = ..., service_class: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("replicas", "held", "held_by_class", "held_by_caller", "runs", "in_flight", "resynced")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_CALLER_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESYNCED_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    held: int
    held_by_class: _containers.RepeatedCompositeFieldContainer[HeldGroup]
    held_by_caller: _containers.RepeatedCompositeFieldContainer[HeldGroup]
    runs: _containers.RepeatedCompositeFieldContainer[RunGroup]
    in_flight: int
    resynced: bool
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., held: _Optional[int] = ..., held_by_class: _Optional[_Iterable[_Union[HeldGroup, _Mapping]]] = ..., held_by_caller: _Optional[_Iterable[_Union[HeldGroup, _Mapping]]] = ..., runs: _Optional[_Iterable[_Union[RunGroup, _Mapping]]] = ..., in_flight: _Optional[int] = ..., resynced: _Optional[bool] = ...) -> None: ...
