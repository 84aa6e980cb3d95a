"""Pipeline schedules as data: the schedule IR, the event simulator (time and memory), the
schedule builders (1F1B, adaptive, interleaved, wave) and the search that picks one that fits."""
