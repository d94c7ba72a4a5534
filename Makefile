# tuvl: durable, agentic workflows inside PostgreSQL (PGXS build)

EXTENSION = tuvl tuvl_router
EXTVERSION = $(shell sed -n "s/^default_version = '\(.*\)'/\1/p" tuvl.control)

MODULE_big = tuvl
# src/ is in one folder a layer (docs/internals.md, "The files, by layer"):
# the objects are every .c of those folders, and init.c, the entry point.
# A new file needs no line here.  The paths are taken from the Makefile's
# own directory, so a VPATH build (test/lib.sh's ASan build) finds them.
TUVL_LAYERS = api agent steps runtime telemetry catalog effects storage support
tuvl_top := $(patsubst %/,%,$(dir $(firstword $(MAKEFILE_LIST))))
tuvl_srcs := $(sort $(wildcard $(tuvl_top)/src/*.c $(foreach d,$(TUVL_LAYERS),$(tuvl_top)/src/$(d)/*.c)))
OBJS = $(patsubst $(tuvl_top)/%.c,%.o,$(tuvl_srcs))

DATA = $(wildcard sql/tuvl--*.sql) $(wildcard sql/tuvl_router--*.sql)
DOCS = README.md

# pg_regress: one file per area, in test/regress/ (sql/ and expected/);
# sql/ holds only the install and update scripts.
REGRESS = version workflow validation template runs steps journal permissions cleanup
REGRESS_OPTS = --inputdir=$(srcdir)/test/regress --load-extension=tuvl

# pg_isolation_regress: sessions racing on the same run
# (test/regress/specs/*.spec, outputs in test/regress/expected/).
# decide_abort talks to the scripted LLM server: test/run passes its URL as
# PGOPTIONS="-c tuvl_test.llm_url=http://127.0.0.1:PORT/v1".
ISOLATION = start_key submit_abort pause_resume abort_step claim_locked decide_abort zz_drop
ISOLATION_OPTS = --inputdir=$(srcdir)/test/regress --load-extension=tuvl


PG_CONFIG ?= pg_config

# -Wall -Wextra, except -Wunused-parameter, which PostgreSQL's own headers
# (lib/ilist.h, storage/bufpage.h, fmgr.h) and every callback signature trip.
PG_CPPFLAGS = -I$(srcdir)/src $(foreach d,$(TUVL_LAYERS),-I$(srcdir)/src/$(d)) \
	$(shell pkg-config --cflags libcurl yaml-0.1) \
	-DTUVL_VERSION=\"$(EXTVERSION)\" -Wall -Wextra -Wno-unused-parameter
SHLIB_LINK = $(shell pkg-config --libs libcurl yaml-0.1) \
	-Wl,--version-script=$(tuvl_top)/exports.map

# LLVM bitcode is not needed and would pull clang into every build.
override with_llvm = no

PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# Every object depends on every local header (a changed struct rebuilds all)
# and on the control file (TUVL_VERSION comes from it).
$(OBJS): $(wildcard $(tuvl_top)/src/*.h $(foreach d,$(TUVL_LAYERS),$(tuvl_top)/src/$(d)/*.h)) tuvl.control

# pgindent's formatting (tools/indent.py: Debian's pg-bsd-indent with
# pgindent's options and its fixes after them), and the typedefs list it
# needs: every typedef name of the headers tuvl compiles against and of its
# own sources.  `make typedefs` after adding a typedef; `make indent` before
# a commit; the structure suite checks that nothing is left to format.
tuvl_c_files = $(sort $(wildcard $(tuvl_top)/src/*.[ch] $(foreach d,$(TUVL_LAYERS),$(tuvl_top)/src/$(d)/*.[ch])))

typedefs:
	$(tuvl_top)/tools/typedefs.py $(shell $(PG_CONFIG) --includedir-server) \
		$(shell pkg-config --variable=includedir libcurl)/curl $(wildcard $(shell pkg-config --variable=includedir libcurl)/$(shell gcc -print-multiarch 2>/dev/null)/curl) \
		$(shell pkg-config --variable=includedir yaml-0.1)/yaml.h -- $(tuvl_c_files) > $(tuvl_top)/typedefs.list

indent:
	$(tuvl_top)/tools/indent.py $(tuvl_c_files)

.PHONY: typedefs indent
