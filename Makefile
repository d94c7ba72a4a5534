# tuvl: durable, agentic workflows inside PostgreSQL (PGXS build)

EXTENSION = tuvl tuvl_router
EXTVERSION = $(shell sed -n "s/^default_version = '\(.*\)'/\1/p" tuvl.control)

MODULE_big = tuvl
OBJS = \
	src/agent.o \
	src/agent_shared.o \
	src/api.o \
	src/artifact.o \
	src/channel.o \
	src/checkpoint.o \
	src/concurrency.o \
	src/compensation.o \
	src/control.o \
	src/deadline.o \
	src/driver.o \
	src/effect.o \
	src/executor.o \
	src/guardrail.o \
	src/hook.o \
	src/http.o \
	src/init.o \
	src/journal.o \
	src/journal_block.o \
	src/judge.o \
	src/jsonschema.o \
	src/jsonutil.o \
	src/launcher.o \
	src/llm.o \
	src/llm_request.o \
	src/mcp.o \
	src/metrics.o \
	src/queue.o \
	src/replay.o \
	src/retention.o \
	src/lease.o \
	src/retry.o \
	src/runtime.o \
	src/schedule.o \
	src/security.o \
	src/spiutil.o \
	src/status.o \
	src/step_agent.o \
	src/step_http.o \
	src/step_sleep.o \
	src/step_sql.o \
	src/step_workflow.o \
	src/supervisor.o \
	src/template.o \
	src/trace.o \
	src/tokens.o \
	src/tuvl.o \
	src/uses.o \
	src/validate.o \
	src/worker.o \
	src/workflow.o \
	src/yamlparse.o

DATA = $(wildcard sql/tuvl--*.sql) $(wildcard sql/tuvl_router--*.sql)
DOCS = README.md

# pg_regress: one file per area, inputs in sql/, outputs in expected/.
REGRESS = version workflow validation template runs steps journal permissions cleanup
REGRESS_OPTS = --load-extension=tuvl

# pg_isolation_regress: sessions racing on the same run (specs/*.spec).
# decide_abort talks to the scripted LLM server: test/run passes its URL as
# PGOPTIONS="-c tuvl_test.llm_url=http://127.0.0.1:PORT/v1".
ISOLATION = start_key submit_abort pause_resume abort_step claim_locked decide_abort zz_drop
ISOLATION_OPTS = --load-extension=tuvl


PG_CONFIG ?= pg_config

# -Wall -Wextra, except -Wunused-parameter, which PostgreSQL's own headers
# (lib/ilist.h, storage/bufpage.h, fmgr.h) and every callback signature trip.
PG_CPPFLAGS = -I$(srcdir)/src $(shell pkg-config --cflags libcurl yaml-0.1) \
	-DTUVL_VERSION=\"$(EXTVERSION)\" -Wall -Wextra -Wno-unused-parameter
SHLIB_LINK = $(shell pkg-config --libs libcurl yaml-0.1)

# LLVM bitcode is not needed and would pull clang into every build.
override with_llvm = no

PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# Every object depends on every local header (a changed struct rebuilds all)
# and on the control file (TUVL_VERSION comes from it).
$(OBJS): $(wildcard src/*.h) tuvl.control
