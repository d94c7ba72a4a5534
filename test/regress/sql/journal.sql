-- The journal's blocks: packed by tuvl._journal_block (as JournalWrite packs
-- a transition's events), unpacked by tuvl._journal_events (the view
-- tuvl.events).  What goes in comes out, and a bytea that is not a block is
-- refused with an error, never misread.
SELECT e.*
FROM tuvl._journal_events(41, tuvl._journal_block(
    ARRAY['2026-01-02 03:04:05.123456+00', '2026-01-02 03:04:05.000001+00', '1999-12-31 23:59:59+00']::timestamptz[],
    ARRAY['agent_completed', 'a_type_without_a_code', 'run_queued'],
    ARRAY['step one', NULL, NULL],
    ARRAY['Functional', 'Engine without a code', NULL],
    ARRAY[NULL, 1234567, 0]::int[],
    ARRAY[0.25, NULL, 0]::float8[],
    ARRAY['{"text": "a b  c", "q": "say \"hi\"", "u": "żółw ☃", "n": [1, 2.5, null, true], "o": {}}',
          '{}', '{"k": " "}']::jsonb[])) e;

-- a large payload survives whole (its length takes more than one byte)
SELECT e.seq, e.type, length(e.payload ->> 'big') AS big, e.payload ->> 'after' AS after
FROM tuvl._journal_events(1, tuvl._journal_block(
    ARRAY[now()], ARRAY['tool_result'], ARRAY['s'], ARRAY['APICall'], ARRAY[NULL]::int[], ARRAY[NULL]::float8[],
    ARRAY[jsonb_build_object('big', repeat('x y', 30000), 'after', 'end')])) e;

-- arrays of different lengths, and NULL arrays, are refused
SELECT tuvl._journal_block(ARRAY[now()], ARRAY['a', 'b'], ARRAY[NULL, NULL]::text[], ARRAY[NULL, NULL]::text[],
    ARRAY[NULL, NULL]::int[], ARRAY[NULL, NULL]::float8[], ARRAY['{}', '{}']::jsonb[]);
SELECT tuvl._journal_block(NULL, ARRAY['a'], ARRAY[NULL]::text[], ARRAY[NULL]::text[],
    ARRAY[NULL]::int[], ARRAY[NULL]::float8[], ARRAY['{}']::jsonb[]);

-- what is not a block
SELECT * FROM tuvl._journal_events(1, '\x'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x02'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x01ff'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x0101'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x010163'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x0101000341424300'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x0101010010027b7d'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x01010100100178'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x010101001000ff'::bytea);
SELECT * FROM tuvl._journal_events(1, '\x0101010000ffffffffffffffffffffff01'::bytea);

-- a real run's journal: one block per transition, seq without gaps
SELECT tuvl.register_workflow($$
name: journal_two
steps:
  - { id: a, kind: Router, on: go, routes: { go: b } }
  - { id: b, kind: Router, on: go, routes: { go: done } }
ends:
  - { id: done, status: completed, response: { ok: true } }
$$);
SELECT (tuvl.run('journal_two') ->> 'run_id')::bigint AS run_id \gset
SELECT seq, n FROM tuvl.journal WHERE run_id = :run_id ORDER BY seq;
SELECT seq, type, agent_id, engine, payload FROM tuvl.events WHERE run_id = :run_id ORDER BY seq;
