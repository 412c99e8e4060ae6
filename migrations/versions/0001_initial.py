"""Initial schema: runs, attempts, steps, thermometer chunks + series dictionary, checkpoints,
findings, incidents, actions (command queue), skip ranges, LR changes, alerts, audit.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:01:58.012278
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('audit',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=True),
    sa.Column('actor', sa.String(length=200), nullable=False),
    sa.Column('event', sa.String(length=100), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit'))
    )
    op.create_index(op.f('ix_audit_run_id_at'), 'audit', ['run_id', 'at'])

    op.create_table('runs',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_runs'))
    )
    op.create_table('series',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('metric', sa.String(length=100), nullable=False),
    sa.Column('module', sa.String(length=300), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_series')),
    sa.UniqueConstraint('metric', 'module', name=op.f('uq_series_metric_module'))
    )
    op.create_table('alerts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=True),
    sa.Column('channel', sa.String(length=200), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_alerts_run_id_runs'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts'))
    )
    op.create_table('attempts',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('start_step', sa.BigInteger(), nullable=False),
    sa.Column('hosts', sa.JSON(), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_attempts_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'attempt', name=op.f('pk_attempts'))
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('sample_cursor', sa.BigInteger(), nullable=False),
    sa.Column('healthy', sa.Boolean(), nullable=False),
    sa.Column('manifest', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_checkpoints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'attempt', 'step', name=op.f('uq_checkpoints_run_id_attempt_step'))
    )
    op.create_table('incidents',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('signal', sa.String(length=50), nullable=False),
    sa.Column('module', sa.String(length=300), nullable=False),
    sa.Column('severity', sa.String(length=20), nullable=False),
    sa.Column('onset_step', sa.BigInteger(), nullable=False),
    sa.Column('detect_step', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resolution', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_incidents_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_incidents'))
    )
    op.create_index(op.f('ix_incidents_run_id_state'), 'incidents', ['run_id', 'state'])

    op.create_table('steps',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('sample_lo', sa.BigInteger(), nullable=False),
    sa.Column('sample_hi', sa.BigInteger(), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('wall_time', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_steps_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'step', 'attempt', name=op.f('pk_steps'))
    )
    op.create_table('run_series',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('series_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_run_series_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_run_series_series_id_series')),
    sa.PrimaryKeyConstraint('run_id', 'series_id', name=op.f('pk_run_series'))
    )
    op.create_table('thermometer_chunks',
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('series_id', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('first_step', sa.BigInteger(), nullable=False),
    sa.Column('last_step', sa.BigInteger(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('steps', sa.LargeBinary(), nullable=True),
    sa.Column('values', sa.LargeBinary(), nullable=False),
    sa.Column('ranks', sa.LargeBinary(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_thermometer_chunks_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_thermometer_chunks_series_id_series')),
    sa.PrimaryKeyConstraint('run_id', 'series_id', 'attempt', 'first_step', name=op.f('pk_thermometer_chunks'))
    )
    op.create_table('actions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=30), nullable=False),
    sa.Column('args', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('origin', sa.String(length=10), nullable=False),
    sa.Column('who', sa.String(length=200), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ack_step', sa.BigInteger(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('requires_approval', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_actions_incident_id_incidents'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_actions_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_actions'))
    )
    op.create_index(op.f('ix_actions_run_id_state'), 'actions', ['run_id', 'state'])

    op.create_table('findings',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('signal', sa.String(length=50), nullable=False),
    sa.Column('module', sa.String(length=300), nullable=False),
    sa.Column('metric', sa.String(length=400), nullable=False),
    sa.Column('severity', sa.String(length=20), nullable=False),
    sa.Column('onset_step', sa.BigInteger(), nullable=False),
    sa.Column('detect_step', sa.BigInteger(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_findings_incident_id_incidents'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_findings_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_findings'))
    )
    op.create_index(op.f('ix_findings_run_id_detect_step'), 'findings', ['run_id', 'detect_step'])

    op.create_table('lr_changes',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('multiplier', sa.Float(), nullable=False),
    sa.Column('start_step', sa.BigInteger(), nullable=False),
    sa.Column('steps', sa.BigInteger(), nullable=True),
    sa.Column('action_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_lr_changes_action_id_actions'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_lr_changes_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_lr_changes'))
    )
    op.create_table('skip_ranges',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=200), nullable=False),
    sa.Column('lo', sa.BigInteger(), nullable=False),
    sa.Column('hi', sa.BigInteger(), nullable=False),
    sa.Column('action_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_skip_ranges_action_id_actions'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_skip_ranges_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_skip_ranges'))
    )


def downgrade() -> None:
    # Indexes go with their tables on both dialects.
    op.drop_table('skip_ranges')
    op.drop_table('lr_changes')
    op.drop_table('findings')
    op.drop_table('actions')
    op.drop_table('thermometer_chunks')
    op.drop_table('run_series')
    op.drop_table('steps')
    op.drop_table('incidents')
    op.drop_table('checkpoints')
    op.drop_table('attempts')
    op.drop_table('alerts')
    op.drop_table('series')
    op.drop_table('runs')
    op.drop_table('audit')
