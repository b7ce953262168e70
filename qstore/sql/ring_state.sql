## <ring>_ring_state: a ring's cursor, read from its generation sequence (a rotation is a
## setval, which leaves no dead tuple); the current slot is generation % slot_count. The
## queue ring's view also carries the counters' trust marker.
##
## Template parameters: s (schema), ring ('queue', 'lease' or 'claim'), slots (its slot count).
CREATE OR REPLACE VIEW ${s}.${ring}_ring_state AS SELECT true AS singleton,
       (g.generation % ${slots})::integer AS current_slot,
       g.generation,
       ${slots} AS slot_count${',' if ring == 'queue' else ''}
% if ring == 'queue':
       c.terminal_counter_trusted_at
% endif
FROM (SELECT coalesce(pg_sequence_last_value('${s}.${ring}_ring_generation'::regclass), 0)
             AS generation) g
% if ring == 'queue':
LEFT JOIN ${s}.counter_state c ON true
% endif
