"""What a process of a run relies on beside its models and stages: several processes agreeing on
one run and stopping together (`multihost`, its child `watchdog`), pieces of work side by side in
one process (`concurrency`), and host memory under the CPU allocator (`host_memory`)."""
